"""The part of TensorBoard's event schema the sidecar reads, built at import time.

Field numbers are TensorBoard's own (tensorboard/compat/proto/event.proto, summary.proto,
tensor.proto, tensor_shape.proto and plugins/hparams/plugin_data.proto); fields not listed here
are kept by protobuf as unknown fields and ignored. The messages live in a private descriptor
pool under the package `sidecar.tb`, so they never clash with TensorBoard's or TensorFlow's own
classes when those are imported in the same process (the tests do, as oracles). Enums
(DataType, DataClass) are declared as plain int32: the wire format is the same and unknown
values stay numbers.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2

_PACKAGE = "sidecar.tb"

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {
    "double": _F.TYPE_DOUBLE,
    "float": _F.TYPE_FLOAT,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
}

# (message, [(field name, number, type, repeated, oneof)]); a type that is not a scalar names a
# message, relative to the package, or absolute with a leading dot. A oneof gives proto3 scalars
# presence: `simple_value: 0.0` must be told apart from no simple_value at all.
_Field = tuple[str, int, str, bool] | tuple[str, int, str, bool, str]
_MESSAGES: list[tuple[str, list[_Field]]] = [
    ("Event", [
        ("wall_time", 1, "double", False),
        ("step", 2, "int64", False),
        ("file_version", 3, "string", False),
        ("summary", 5, "Summary", False),
    ]),
    ("Summary", [("value", 1, "Summary.Value", True)]),
    ("Summary.Value", [
        ("tag", 1, "string", False),
        ("simple_value", 2, "float", False, "value"),
        ("tensor", 8, "TensorProto", False, "value"),
        ("metadata", 9, "SummaryMetadata", False),
    ]),
    ("SummaryMetadata", [
        ("plugin_data", 1, "SummaryMetadata.PluginData", False),
        ("display_name", 2, "string", False),
        ("summary_description", 3, "string", False),
        ("data_class", 4, "int32", False),
    ]),
    ("SummaryMetadata.PluginData", [
        ("plugin_name", 1, "string", False),
        ("content", 2, "bytes", False),
    ]),
    ("TensorShapeProto", [
        ("dim", 2, "TensorShapeProto.Dim", True),
        ("unknown_rank", 3, "bool", False),
    ]),
    ("TensorShapeProto.Dim", [("size", 1, "int64", False), ("name", 2, "string", False)]),
    ("TensorProto", [
        ("dtype", 1, "int32", False),
        ("tensor_shape", 2, "TensorShapeProto", False),
        ("tensor_content", 4, "bytes", False),
        ("float_val", 5, "float", True),
        ("double_val", 6, "double", True),
        ("int_val", 7, "int32", True),
        ("int64_val", 10, "int64", True),
        ("bool_val", 11, "bool", True),
        ("half_val", 13, "int32", True),
        ("uint32_val", 16, "uint32", True),
        ("uint64_val", 17, "uint64", True),
    ]),
    ("HParamsPluginData", [
        ("version", 1, "int32", False),
        ("session_start_info", 3, "SessionStartInfo", False),
    ]),
    ("SessionStartInfo", [
        ("hparams", 1, "SessionStartInfo.HparamsEntry", True),
        ("model_uri", 2, "string", False),
        ("monitor_url", 3, "string", False),
        ("group_name", 4, "string", False),
        ("start_time_secs", 5, "double", False),
    ]),
    ("SessionStartInfo.HparamsEntry", [
        ("key", 1, "string", False),
        ("value", 2, ".google.protobuf.Value", False),
    ]),
]
_MAP_ENTRIES = {"SessionStartInfo.HparamsEntry"}


def _file_proto() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(
        name="sidecar/tensorboard_events.proto", package=_PACKAGE, syntax="proto3",
        dependency=[struct_pb2.DESCRIPTOR.name])
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full_name, fields in _MESSAGES:
        parent, _, name = full_name.rpartition(".")
        container = protos[parent].nested_type if parent else fdp.message_type
        msg = container.add(name=name)
        protos[full_name] = msg
        if full_name in _MAP_ENTRIES:
            msg.options.map_entry = True
        for field_name, number, type_name, repeated, *oneof in fields:
            field = msg.field.add(name=field_name, number=number, json_name=field_name)
            if oneof:
                names = [d.name for d in msg.oneof_decl]
                if oneof[0] not in names:
                    msg.oneof_decl.add(name=oneof[0])
                    names.append(oneof[0])
                field.oneof_index = names.index(oneof[0])
            field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            if type_name in _TYPES:
                field.type = _TYPES[type_name]
            else:
                field.type = _F.TYPE_MESSAGE
                field.type_name = (type_name if type_name.startswith(".")
                                   else f".{_PACKAGE}.{type_name}")
    return fdp


def _build() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(_file_proto().SerializeToString())
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name, _ in _MESSAGES if name not in _MAP_ENTRIES}


_CLASSES = _build()
Event: Any = _CLASSES["Event"]
HParamsPluginData: Any = _CLASSES["HParamsPluginData"]
TensorProto: Any = _CLASSES["TensorProto"]

# TensorFlow's DataType numbers (tensorflow/core/framework/types.proto).
DT_FLOAT = 1
DT_DOUBLE = 2
DT_INT32 = 3
DT_UINT8 = 4
DT_INT16 = 5
DT_INT8 = 6
DT_INT64 = 9
DT_BOOL = 10
DT_BFLOAT16 = 14
DT_UINT16 = 17
DT_HALF = 19
DT_UINT32 = 22
DT_UINT64 = 23
