"""Where a rank's time goes: a sample of its main thread's stack, read from outside with py-spy
as stacks.py reads it, placed in one of four categories by the frames it holds.

    collective  in a torch.distributed collective, or waiting on one: the rank waits for others
    data        waiting for its next batch: the DataLoader, and what wraps it
    checkpoint  inside a save: torch.save, torch.distributed.checkpoint, safetensors, the
                trainers' own save calls
    compute     everything else: forward, backward, the optimizer, the trainer's own code

A sample counts one category, so that the shares of a rank's samples add up to its time. The
frames are matched against RULES, a row a file of an installed package and the functions in it
that say where the thread is. A row names the function the thread waits in when that is the
innermost Python frame of the wait (a collective's C++ call has no Python frame of its own
beneath it), or the entry point a library's activity runs under when time spent anywhere under it
belongs to it (a save, a fetch). Files are named by the end of their path, as they appear under
site-packages or a source checkout; functions by their own name, whether py-spy gives it plain
or qualified (`_BaseDataLoaderIter.__next__` on Python 3.11 and later).

Only Python frames are read: a native frame's file is a shared library's. So a wait entered from
C++ without a Python frame of torch.distributed above it is not seen as one: DDP's gradient
all-reduce, waited for inside `loss.backward()`, counts as compute, and so does a trainer's own
`work.wait()` on a collective started with `async_op=True`. On a GPU, NCCL collectives are queued
on a stream and return at once; the host waits where it next synchronises (`.item()`, a copy to
the CPU), which counts as compute too: `collective` is the time the host thread itself spent
blocked in one (gloo, barriers, object collectives, a store), not the GPU's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

COLLECTIVE = "collective"
DATA = "data"
CHECKPOINT = "checkpoint"
COMPUTE = "compute"
# in the order a frame of one outranks a frame of the next, wherever they are in the stack
CATEGORIES = (CHECKPOINT, DATA, COLLECTIVE, COMPUTE)


class Rule(NamedTuple):
    """Frames that place a thread in a category: functions of one file of a package."""

    category: str
    file: str  # the end of the frame's file path, from the package's own folder down
    functions: tuple[str, ...]  # their own names: __next__ matches _BaseDataLoaderIter.__next__
    where: str  # what these functions are, in the package's source


RULES = (
    # -- checkpoint: time anywhere under a save is the save's, its collectives included
    Rule(CHECKPOINT, "torch/serialization.py", ("save",),
         "torch.save: the zip writer, _save's record a storage, the writes to the file"),
    Rule(CHECKPOINT, "torch/distributed/checkpoint/state_dict_saver.py",
         ("save", "async_save", "save_state_dict"),
         "torch.distributed.checkpoint: the plan gathered on the coordinator, reduced and "
         "scattered back, each rank's writes, the metadata; async_save's staging"),
    Rule(CHECKPOINT, "safetensors/torch.py", ("save_file", "save", "save_model"),
         "safetensors: save_file is one call into the Rust serialize_file, which writes the "
         "whole file; save_model removes shared tensors first"),
    Rule(CHECKPOINT, "transformers/modeling_utils.py", ("save_pretrained",),
         "transformers' PreTrainedModel.save_pretrained: the config, the shards through "
         "safetensors or torch.save"),
    Rule(CHECKPOINT, "transformers/trainer.py", ("_save_checkpoint", "save_model"),
         "transformers' Trainer._save_checkpoint: model, optimizer, scheduler, RNG and trainer "
         "state, a barrier where the best checkpoint is tracked; Trainer.save_model"),
    Rule(CHECKPOINT, "accelerate/accelerator.py", ("save_state", "save_model", "save"),
         "accelerate's Accelerator.save_state (checkpointing.save_accelerator_state beneath), "
         "save_model (safetensors shards), save"),
    Rule(CHECKPOINT, "lightning/pytorch/trainer/trainer.py", ("save_checkpoint",),
         "Lightning's Trainer.save_checkpoint, which ModelCheckpoint calls: the checkpoint "
         "dumped, the strategy's save (cloud_io._atomic_save: torch.save to memory, then "
         "fsspec's write), then a barrier"),
    Rule(CHECKPOINT, "pytorch_lightning/trainer/trainer.py", ("save_checkpoint",),
         "the same Trainer.save_checkpoint in the pytorch_lightning package"),
    Rule(CHECKPOINT, "lightning/fabric/fabric.py", ("save",),
         "Lightning's Fabric.save: the strategy's save_checkpoint, then a barrier"),
    Rule(CHECKPOINT, "deepspeed/runtime/engine.py", ("save_checkpoint", "save_16bit_model"),
         "DeepSpeed's DeepSpeedEngine.save_checkpoint, its writes between barriers; "
         "save_16bit_model, ZeRO-3's weights gathered first"),
    # -- data: time under the next batch's fetch is the data pipeline's, its collectives too
    Rule(DATA, "torch/utils/data/dataloader.py",
         ("__next__", "_next_data", "_get_data", "_try_get_data", "__iter__"),
         "torch's DataLoader: _BaseDataLoaderIter.__next__ and beneath it the fetch in the main "
         "process (num_workers=0) or the get from the workers' queue (_try_get_data), or from "
         "the pin-memory thread's; DataLoader.__iter__, an epoch's start: workers started, a "
         "process group made and a seed broadcast for a data pipe under torch.distributed"),
    Rule(DATA, "accelerate/data_loader.py", ("__iter__", "_fetch_batches"),
         "accelerate's DataLoaderShard.__iter__ (RNG states broadcast at an epoch's start, one "
         "batch read ahead, the copy to the device), DataLoaderDispatcher (rank 0 reads, "
         "broadcasts each batch), SkipDataLoader"),
    Rule(DATA, "transformers/trainer.py", ("get_batch_samples",),
         "transformers' Trainer.get_batch_samples: a step's batches from the epoch iterator, "
         "then the label tokens counted across ranks (a gather)"),
    Rule(DATA, "lightning/pytorch/loops/fetchers.py", ("__next__", "__iter__"),
         "Lightning's _DataFetcher and _PrefetchDataFetcher (the fit loop's next batch through "
         "CombinedLoader, one fetched ahead), _DataFetcherWrapper for dataloader_iter steps"),
    Rule(DATA, "pytorch_lightning/loops/fetchers.py", ("__next__", "__iter__"),
         "the same fetchers in the pytorch_lightning package"),
    Rule(DATA, "lightning/fabric/wrappers.py", ("__iter__",),
         "Lightning's _FabricDataLoader.__iter__: the sampler's epoch set, each batch moved to "
         "the device"),
    # -- collective: the innermost frame of a wait for the other ranks
    Rule(COLLECTIVE, "torch/distributed/distributed_c10d.py",
         ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
          "all_gather_single", "all_gather_coalesced", "all_gather_object", "_all_gather_base",
          "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
          "_reduce_scatter_base", "reduce", "broadcast", "broadcast_object_list", "gather",
          "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
          "barrier", "monitored_barrier", "send", "recv", "send_object_list",
          "recv_object_list", "init_process_group", "new_group"),
         "torch.distributed's collectives, each waiting in work.wait() when not async_op; "
         "point-to-point send and recv (a pipeline stage waiting on its neighbour); the "
         "rendezvous of init_process_group and new_group's store barrier. DeepSpeed's "
         "deepspeed.comm calls these (deepspeed/comm/torch.py), as FSDP's do"),
    Rule(COLLECTIVE, "torch/distributed/_functional_collectives.py", ("wait_tensor",),
         "torch's functional collectives (DTensor, tensor parallel): an AsyncCollectiveTensor's "
         "first use waits here"),
    Rule(COLLECTIVE, "torch/nn/parallel/distributed.py",
         ("_pre_forward", "_sync_buffers", "_distributed_broadcast_coalesced"),
         "DDP's forward: buffers broadcast from rank 0 by dist._broadcast_coalesced, the "
         "buckets' order agreed across ranks once after the first step "
         "(reducer._rebuild_buckets), both C++ calls under DistributedDataParallel._pre_forward"),
    Rule(COLLECTIVE, "torch/distributed/utils.py",
         ("_verify_param_shape_across_processes", "_sync_params_and_buffers"),
         "DDP's construction: parameter shapes compared across ranks, parameters and buffers "
         "broadcast from rank 0, both C++ calls"),
    Rule(COLLECTIVE, "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
         ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"),
         "FSDP2 (fully_shard): the unshard's all-gather and its all_gather_work.wait() in the "
         "copy-out, the gradients' reduce-scatter"),
    Rule(COLLECTIVE, "deepspeed/runtime/zero/partition_parameters.py", ("wait",),
         "DeepSpeed ZeRO-3: AllGatherHandle.wait and AllGatherCoalescedHandle.wait, a "
         "parameter's all-gather awaited before its use"),
)

_RANK = {category: rank for rank, category in enumerate(CATEGORIES)}


def _by_function(rules: Iterable[Rule]) -> dict[str, tuple[Rule, ...]]:
    """A function's own name -> the rows that name it: a frame is looked up by its name, then
    its file, so that a sample costs a dictionary lookup a frame."""
    found: dict[str, tuple[Rule, ...]] = {}
    for rule in rules:
        for function in rule.functions:
            found[function] = (*found.get(function, ()), rule)
    return found


_BY_FUNCTION = _by_function(RULES)


def rule_of(frame: Mapping[str, Any]) -> Rule | None:
    """The row a py-spy frame matches, if any; never a native frame's (its file is a library)."""
    if frame.get("module") is not None:
        return None
    # py-spy names a frame by its qualified name where the interpreter has one (3.11 and later):
    # `_BaseDataLoaderIter.__next__`, `_exception_logger.<locals>.wrapper`
    rules = _BY_FUNCTION.get(str(frame.get("name", "")).rpartition(".")[2])
    if not rules:
        return None
    path = str(frame.get("filename") or frame.get("short_filename") or "")
    return next((rule for rule in rules
                 if path == rule.file or path.endswith("/" + rule.file)), None)


def deciding(frames: Iterable[Mapping[str, Any]]) -> Rule | None:
    """The row that places a thread whose frames (innermost first, as py-spy gives them) these
    are: of the frames that match one, the innermost of the category that comes first in
    CATEGORIES; None: compute.

    The category, not the innermost frame, decides because the activities nest one way. A save
    waits in collectives: torch.distributed.checkpoint gathers its plan (gather_object inside
    save), Lightning's Trainer.save_checkpoint, Fabric.save, transformers' Trainer and DeepSpeed
    end theirs on a barrier. A fetch does too: accelerate broadcasts RNG states and, dispatching,
    each batch; transformers' Trainer gathers a step's token count; the DataLoader makes a
    process group and broadcasts a seed at an epoch's start for a data pipe under
    torch.distributed. A rank waiting there waits because of the save or the fetch, and what the
    shares answer is which activity costs a step its time: the user who sees `checkpoint` learns
    that saves are slow, where `collective` would send them looking for a straggler. A collective
    is every activity's meeting point and says least; it counts only where no save or fetch
    holds it. A save outranks a fetch for the rare stack holding both (a dataset that
    torch.saves a cache in the main process): a save's samples are few and long, each worth
    keeping. The innermost frame of the winning category names the row, the most precise one
    that says it.
    """
    found: Rule | None = None
    for frame in frames:
        rule = rule_of(frame)
        if rule is not None and (found is None or _RANK[rule.category] < _RANK[found.category]):
            found = rule
            if rule.category == CATEGORIES[0]:
                break
    return found


def category_of(frames: Iterable[Mapping[str, Any]]) -> str:
    """One thread's category from its py-spy frames, innermost first (see `deciding`)."""
    rule = deciding(frames)
    return rule.category if rule is not None else COMPUTE
