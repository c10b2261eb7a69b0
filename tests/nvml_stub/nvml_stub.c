/*
 * A stand-in libnvidia-ml.so.1 for the tests: the real nvidia-ml-py bindings load it through
 * the same CDLL("libnvidia-ml.so.1") as the real driver library, and it answers from a script.
 *
 * The script is a text file named by NVML_STUB_SCRIPT, one "key value" per line:
 *
 *   count 2                       GPUs on the node
 *   driver 550.54.15              nvmlSystemGetDriverVersion
 *   cuda 12040                    nvmlSystemGetCudaDriverVersion(_v2)
 *   init_error 9                  nvmlInitWithFlags fails with this code (9: driver not loaded)
 *   0.uuid GPU-...  0.name ...    per GPU (index.field); fields are listed in set_field below
 *   0.fail.nvmlDeviceGetPowerUsage 3    that call on GPU 0 always returns code 3 (not supported)
 *   1.hang.nvmlDeviceGetPowerUsage 1500 the first such call on GPU 1 blocks 1500 ms
 *   1.lost_after 2                the 3rd utilization read, and every call after it on GPU 1,
 *                                 fails GPU_IS_LOST
 *   0.procs 0:1048576,1:4096      compute processes "pid:bytes"; pid 0 stands for the caller
 *
 * Counters advance by a step on every read, so consecutive samples see a known rate. The
 * exported stubCallCount(gpu, name) lets a test see which calls were made how often.
 */
#define _GNU_SOURCE
#include <nvml.h>
#include <pthread.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_GPUS 16
#define MAX_MIG 7
#define MAX_FAULTS 8
#define MAX_PROCS 8
#define MAX_NAMES 64
#define NVLINK_TS0_US 1700000000000000LL

struct nvmlDevice_st {
    int gpu;
    int mig; /* -1 for the GPU itself, else the MIG instance */
};

struct fault {
    int name_id;
    int code;    /* returned instead of success, when non-zero */
    int hang_ms; /* blocks once for this long, when non-zero */
};

struct gpu {
    struct nvmlDevice_st handle;
    struct nvmlDevice_st mig_handles[MAX_MIG];
    char uuid[96], name[96];
    unsigned util_gpu, util_mem, temp, power_mw, power_limit_mw, clock_sm, clock_mem;
    unsigned pcie_tx_kb, pcie_rx_kb, nvlink_links, mig, gpm, xid, remap_corr, remap_unc;
    unsigned remap_pending, remap_failure, lost_after, cc_major, cc_minor;
    unsigned long long mem_total, mem_used, mem_reserved, energy_mj, energy_step_mj;
    unsigned long long nvlink_tx_kib, nvlink_rx_kib, nvlink_step_kib, nvlink_step_us;
    unsigned long long clock_events, ecc_corr, ecc_uncorr;
    long long nvlink_ts_us;
    int nprocs;
    unsigned proc_pid[MAX_PROCS];
    unsigned long long proc_mem[MAX_PROCS];
    int nfaults;
    struct fault faults[MAX_FAULTS];
    unsigned util_reads;
    int lost;
    int xid_delivered;
    int events_registered;
};

struct nvmlEventSet_st {
    int unused;
};

struct nvmlGpmSample_st {
    int taken;
};

static struct gpu gpus[MAX_GPUS];
static unsigned gpu_count;
static char driver_version[80] = "550.54.15";
static int cuda_version = 12040;
static int init_error;
static int initialised;
static const char *names[MAX_NAMES];
static int name_count;
static unsigned long long calls[MAX_GPUS + 1][MAX_NAMES];

/* NVML's reference count of nvmlInit is thread-safe: the sampler's thread and the environment
 * snapshot's may init and shut down at once (an unlocked count lost an increment, and the
 * sampler then read "Uninitialized"). The name table is shared by every thread too. */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER; /* held while the script loads */
static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;

static int name_id(const char *name) {
    pthread_mutex_lock(&names_lock);
    int id = 0;
    while (id < name_count && strcmp(names[id], name) != 0)
        id++;
    if (id == name_count) {
        if (name_count == MAX_NAMES)
            id = MAX_NAMES - 1;
        else
            names[name_count++] = strdup(name);
    }
    pthread_mutex_unlock(&names_lock);
    return id;
}

static void sleep_ms(unsigned ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Count the call, then apply the GPU's scripted faults: lost, a fault code, or a hang. */
static nvmlReturn_t enter(struct nvmlDevice_st *dev, int *id, const char *name) {
    if (*id < 0)
        *id = name_id(name);
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (dev == NULL || dev->gpu < 0 || (unsigned)dev->gpu >= gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct gpu *g = &gpus[dev->gpu];
    __atomic_fetch_add(&calls[dev->gpu][*id], 1, __ATOMIC_RELAXED);
    if (g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    for (int i = 0; i < g->nfaults; i++) {
        struct fault *f = &g->faults[i];
        if (f->name_id != *id)
            continue;
        if (f->hang_ms) {
            int ms = f->hang_ms;
            f->hang_ms = 0;
            sleep_ms((unsigned)ms);
        }
        if (f->code)
            return (nvmlReturn_t)f->code;
    }
    return NVML_SUCCESS;
}

#define ENTER(dev)                                                                            \
    static int name_id_ = -1;                                                                 \
    nvmlReturn_t entered_ = enter((dev), &name_id_, __func__);                                \
    if (entered_ != NVML_SUCCESS)                                                             \
        return entered_;                                                                      \
    struct gpu *g = &gpus[(dev)->gpu];                                                        \
    (void)g

#define WHOLE_GPU_ONLY(dev)                                                                   \
    if ((dev)->mig >= 0)                                                                      \
    return NVML_ERROR_NOT_SUPPORTED

static void count_system_call(int *id, const char *name) {
    if (*id < 0)
        *id = name_id(name);
    __atomic_fetch_add(&calls[MAX_GPUS][*id], 1, __ATOMIC_RELAXED);
}

#define SYSTEM_CALL()                                                                         \
    static int name_id_ = -1;                                                                 \
    count_system_call(&name_id_, __func__);                                                   \
    if (!initialised)                                                                         \
    return NVML_ERROR_UNINITIALIZED

static void parse_procs(struct gpu *g, const char *value) {
    const char *p = value;
    g->nprocs = 0;
    while (*p && g->nprocs < MAX_PROCS) {
        unsigned pid;
        unsigned long long mem;
        int used;
        if (sscanf(p, "%u:%llu%n", &pid, &mem, &used) != 2)
            break;
        g->proc_pid[g->nprocs] = pid ? pid : (unsigned)getpid();
        g->proc_mem[g->nprocs] = mem;
        g->nprocs++;
        p += used;
        if (*p == ',')
            p++;
    }
}

static void add_fault(struct gpu *g, const char *fn, int code, int hang_ms) {
    if (g->nfaults == MAX_FAULTS)
        return;
    struct fault *f = &g->faults[g->nfaults++];
    f->name_id = name_id(fn);
    f->code = code;
    f->hang_ms = hang_ms;
}

#define FIELD_U(field_name)                                                                   \
    if (strcmp(field, #field_name) == 0) {                                                    \
        g->field_name = (unsigned)strtoul(value, NULL, 0);                                    \
        return;                                                                               \
    }
#define FIELD_ULL(field_name)                                                                 \
    if (strcmp(field, #field_name) == 0) {                                                    \
        g->field_name = strtoull(value, NULL, 0);                                             \
        return;                                                                               \
    }
#define FIELD_STR(field_name)                                                                 \
    if (strcmp(field, #field_name) == 0) {                                                    \
        snprintf(g->field_name, sizeof g->field_name, "%s", value);                           \
        return;                                                                               \
    }

static void set_field(struct gpu *g, const char *field, const char *value) {
    if (strncmp(field, "fail.", 5) == 0) {
        add_fault(g, field + 5, atoi(value), 0);
        return;
    }
    if (strncmp(field, "hang.", 5) == 0) {
        add_fault(g, field + 5, 0, atoi(value));
        return;
    }
    if (strcmp(field, "procs") == 0) {
        parse_procs(g, value);
        return;
    }
    FIELD_STR(uuid) FIELD_STR(name)
    FIELD_U(util_gpu) FIELD_U(util_mem) FIELD_U(temp) FIELD_U(power_mw) FIELD_U(power_limit_mw)
    FIELD_U(clock_sm) FIELD_U(clock_mem) FIELD_U(pcie_tx_kb) FIELD_U(pcie_rx_kb)
    FIELD_U(nvlink_links) FIELD_U(mig) FIELD_U(gpm) FIELD_U(xid) FIELD_U(remap_corr)
    FIELD_U(remap_unc) FIELD_U(remap_pending) FIELD_U(remap_failure) FIELD_U(lost_after)
    FIELD_U(cc_major) FIELD_U(cc_minor)
    FIELD_ULL(mem_total) FIELD_ULL(mem_used) FIELD_ULL(mem_reserved) FIELD_ULL(energy_mj)
    FIELD_ULL(energy_step_mj) FIELD_ULL(nvlink_tx_kib) FIELD_ULL(nvlink_rx_kib)
    FIELD_ULL(nvlink_step_kib) FIELD_ULL(nvlink_step_us) FIELD_ULL(clock_events)
    FIELD_ULL(ecc_corr) FIELD_ULL(ecc_uncorr)
    fprintf(stderr, "nvml stub: unknown field %s\n", field);
}

static void reset_gpu(int i) {
    struct gpu *g = &gpus[i];
    memset(g, 0, sizeof *g);
    g->handle.gpu = i;
    g->handle.mig = -1;
    for (int m = 0; m < MAX_MIG; m++) {
        g->mig_handles[m].gpu = i;
        g->mig_handles[m].mig = m;
    }
    snprintf(g->uuid, sizeof g->uuid, "GPU-00000000-0000-0000-0000-0000000000%02d", i);
    snprintf(g->name, sizeof g->name, "NVIDIA Stand-in GPU");
    g->mem_total = 80ULL << 30;
    g->nvlink_ts_us = NVLINK_TS0_US;
    g->cc_major = 9;
}

static void load_script(void) {
    gpu_count = 0;
    init_error = 0;
    for (int i = 0; i < MAX_GPUS; i++)
        reset_gpu(i);
    const char *path = getenv("NVML_STUB_SCRIPT");
    FILE *fh = path ? fopen(path, "r") : NULL;
    if (fh == NULL)
        return;
    char line[512];
    while (fgets(line, sizeof line, fh)) {
        line[strcspn(line, "\r\n")] = 0;
        char *value = strchr(line, ' ');
        if (value == NULL)
            continue;
        *value++ = 0;
        if (strcmp(line, "count") == 0)
            gpu_count = (unsigned)atoi(value) > MAX_GPUS ? MAX_GPUS : (unsigned)atoi(value);
        else if (strcmp(line, "driver") == 0)
            snprintf(driver_version, sizeof driver_version, "%s", value);
        else if (strcmp(line, "cuda") == 0)
            cuda_version = atoi(value);
        else if (strcmp(line, "init_error") == 0)
            init_error = atoi(value);
        else {
            char *dot = strchr(line, '.');
            int index = atoi(line);
            if (dot != NULL && index >= 0 && index < MAX_GPUS)
                set_field(&gpus[index], dot + 1, value);
        }
    }
    fclose(fh);
}

/* ---- test backdoor ---------------------------------------------------------------------- */

unsigned long long stubCallCount(int gpu, const char *name) {
    int id = name_id(name);
    return calls[gpu < 0 ? MAX_GPUS : gpu][id];
}

/* ---- library and system ----------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t result = NVML_SUCCESS;
    pthread_mutex_lock(&init_lock);
    if (!initialised) {
        load_script();
        result = (nvmlReturn_t)init_error;
    }
    if (result == NVML_SUCCESS)
        initialised++;
    pthread_mutex_unlock(&init_lock);
    return result;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&init_lock);
    nvmlReturn_t result = initialised ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (initialised)
        initialised--;
    pthread_mutex_unlock(&init_lock);
    return result;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    static char text[64];
    snprintf(text, sizeof text, "stand-in NVML error %d", (int)result);
    return text;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    SYSTEM_CALL();
    snprintf(version, length, "%s", driver_version);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    SYSTEM_CALL();
    snprintf(version, length, "12.%s", driver_version);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    SYSTEM_CALL();
    *version = cuda_version;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    return nvmlSystemGetCudaDriverVersion(version);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    SYSTEM_CALL();
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    SYSTEM_CALL();
    if (index >= gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index].handle;
    return NVML_SUCCESS;
}

/* ---- identity --------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER(device);
    if (device->mig >= 0)
        snprintf(uuid, length, "MIG-%08d-0000-0000-0000-0000000000%02d", device->gpu, device->mig);
    else
        snprintf(uuid, length, "%s", g->uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER(device);
    snprintf(name, length, "%s", g->name);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER(device);
    *index = (unsigned)device->gpu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    ENTER(device);
    *major = (int)g->cc_major;
    *minor = (int)g->cc_minor;
    return NVML_SUCCESS;
}

/* ---- gauges ----------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    if (g->lost_after && g->util_reads >= g->lost_after) { /* falls off the bus right here */
        g->lost = 1;
        return NVML_ERROR_GPU_IS_LOST;
    }
    g->util_reads++;
    util->gpu = g->util_gpu;
    util->memory = g->util_mem;
    return NVML_SUCCESS;
}

static void mig_memory(struct gpu *g, int mig, unsigned long long *total,
                       unsigned long long *used) {
    *total = g->mem_total / (g->mig ? g->mig : 1);
    *used = (unsigned long long)(mig + 1) << 20;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER(device);
    if (device->mig >= 0)
        mig_memory(g, device->mig, &memory->total, &memory->used);
    else {
        memory->total = g->mem_total;
        memory->used = g->mem_used + g->mem_reserved;
    }
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER(device);
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->reserved = 0;
    if (device->mig >= 0)
        mig_memory(g, device->mig, &memory->total, &memory->used);
    else {
        memory->total = g->mem_total;
        memory->used = g->mem_used;
        memory->reserved = g->mem_reserved;
    }
    memory->free = memory->total - memory->used - memory->reserved;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensor,
                                      unsigned int *temp) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    if (sensor != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = g->temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *power = g->power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *limit = g->power_limit_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                 unsigned long long *energy) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *energy = g->energy_mj;
    g->energy_mj += g->energy_step_mj;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                    unsigned int *clock) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    if (type == NVML_CLOCK_SM)
        *clock = g->clock_sm;
    else if (type == NVML_CLOCK_MEM)
        *clock = g->clock_mem;
    else
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, nvmlPcieUtilCounter_t counter,
                                         unsigned int *value) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *value = counter == NVML_PCIE_UTIL_TX_BYTES ? g->pcie_tx_kb : g->pcie_rx_kb;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *reasons) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *reasons = g->clock_events;
    return NVML_SUCCESS;
}

/* What drivers before 535 call the same thing. */
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *reasons) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *reasons = g->clock_events;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t type,
                                         nvmlEccCounterType_t counter,
                                         unsigned long long *count) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    if (counter != NVML_VOLATILE_ECC)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = type == NVML_MEMORY_ERROR_TYPE_CORRECTED ? g->ecc_corr : g->ecc_uncorr;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corr,
                                       unsigned int *unc, unsigned int *pending,
                                       unsigned int *failure) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *corr = g->remap_corr;
    *unc = g->remap_unc;
    *pending = g->remap_pending;
    *failure = g->remap_failure;
    return NVML_SUCCESS;
}

/* NVLink throughput counters (KiB per link, with NVML's own microsecond timestamps). */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count, nvmlFieldValue_t *values) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    int advanced = 0;
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->nvmlReturn = NVML_SUCCESS;
        v->latencyUsec = 0;
        if (v->fieldId == NVML_FI_DEV_NVLINK_LINK_COUNT) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal = g->nvlink_links;
            v->timestamp = g->nvlink_ts_us;
            continue;
        }
        if ((v->fieldId != NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX &&
             v->fieldId != NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX) ||
            g->nvlink_links == 0 || v->scopeId >= g->nvlink_links) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        if (!advanced) {
            g->nvlink_tx_kib += g->nvlink_step_kib;
            g->nvlink_rx_kib += 2 * g->nvlink_step_kib;
            g->nvlink_ts_us += (long long)g->nvlink_step_us;
            advanced = 1;
        }
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        v->value.ullVal = v->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX ? g->nvlink_tx_kib
                                                                              : g->nvlink_rx_kib;
        v->timestamp = g->nvlink_ts_us;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    if (infos == NULL || *count < (unsigned)g->nprocs) {
        *count = (unsigned)g->nprocs;
        return g->nprocs ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (int i = 0; i < g->nprocs; i++) {
        memset(&infos[i], 0, sizeof infos[i]);
        infos[i].pid = g->proc_pid[i];
        infos[i].usedGpuMemory = g->proc_mem[i];
    }
    *count = (unsigned)g->nprocs;
    return NVML_SUCCESS;
}

/* ---- MIG -------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                  unsigned int *pending) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *current = *pending = g->mig ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    *count = MAX_MIG;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    if (index >= g->mig || index >= MAX_MIG)
        return NVML_ERROR_NOT_FOUND;
    *mig = &g->mig_handles[index];
    return NVML_SUCCESS;
}

/* ---- GPM -------------------------------------------------------------------------------- */

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    support->isSupportedDevice = g->gpm;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    *sample = calloc(1, sizeof **sample);
    return *sample ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) {
    free(sample);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    if (!g->gpm)
        return NVML_ERROR_NOT_SUPPORTED;
    sample->taken = 1;
    return NVML_SUCCESS;
}

/* Every metric m reads m * 1.5, so a test knows what each interval average should be. */
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *get) {
    if (get->version != NVML_GPM_METRICS_GET_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (get->sample1 == NULL || get->sample2 == NULL || !get->sample1->taken ||
        !get->sample2->taken)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < get->numMetrics; i++) {
        get->metrics[i].nvmlReturn = NVML_SUCCESS;
        get->metrics[i].value = get->metrics[i].metricId * 1.5;
    }
    return NVML_SUCCESS;
}

/* ---- XID events ------------------------------------------------------------------------- */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    SYSTEM_CALL();
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      nvmlEventSet_t set) {
    ENTER(device);
    WHOLE_GPU_ONLY(device);
    (void)set;
    if (types & nvmlEventTypeXidCriticalError)
        g->events_registered = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int ms) {
    SYSTEM_CALL();
    (void)set;
    for (unsigned i = 0; i < gpu_count; i++) {
        struct gpu *g = &gpus[i];
        if (g->events_registered && g->xid && !g->xid_delivered) {
            g->xid_delivered = 1;
            memset(data, 0, sizeof *data);
            data->device = &g->handle;
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = g->xid;
            return NVML_SUCCESS;
        }
    }
    sleep_ms(ms);
    return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    free(set);
    return NVML_SUCCESS;
}
