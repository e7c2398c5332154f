"""Reading a torch.distributed.checkpoint (DCP) folder without running code from it: DCP's
reader unpickles its ``.metadata`` with ``pickle.load`` and its non-tensor values with
torch's loader with ``weights_only`` off, so a folder made to match its manifest could run a
command when loaded. Here the metadata is read by an unpickler that builds only DCP's own metadata
types (and torch's sizes, dtypes and layouts, paths), and non-tensor values are read with
``weights_only=True`` (plain data: numbers, strings, tuples, lists, dicts, tensors); anything
else is refused, naming it (``UnsafeCheckpoint``)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_META = "torch.distributed.checkpoint.metadata"
ALLOWED = frozenset({
    (_META, "Metadata"), (_META, "TensorStorageMetadata"), (_META, "TensorProperties"),
    (_META, "_MEM_FORMAT_ENCODING"), (_META, "ChunkStorageMetadata"),
    (_META, "BytesStorageMetadata"), (_META, "MetadataIndex"), (_META, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"), ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
})
"""The (module, name) pairs a DCP ``.metadata`` may refer to (besides torch's dtypes)."""


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint's metadata or value refers to something other than plain data."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in ALLOWED:
            raise UnsafeCheckpoint(f"its .metadata refers to {module}.{name}, which DCP's "
                                   f"metadata never holds (refused: unpickling it could run "
                                   f"code)")
        return super().find_class(module, name)


def read_metadata(stream: Any) -> Metadata:
    """DCP's ``Metadata`` from ``stream``, built only from DCP's own types."""
    found = _MetadataUnpickler(stream).load()
    if not isinstance(found, Metadata):
        raise UnsafeCheckpoint(f"its .metadata holds a {type(found).__name__}, not DCP's "
                               f"Metadata")
    return found


class SafeReader(FileSystemReader):
    """DCP's file-system reader, its metadata read by ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = read_metadata(stream)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values as plain data only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"its value {read_item.dest_index.fqn!r} is not plain data "
                                   f"({str(exc).strip().splitlines()[0][:160]})") from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
