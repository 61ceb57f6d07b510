"""Reading a sharded run's model (torch.distributed.checkpoint files, `step_NNNNNN/model/`) without
running anything its files hold.

DCP's own FileSystemReader unpickles `.metadata` with no restriction, and its default load
planner reads any entry the metadata calls "bytes" with an unrestricted torch.load: either
runs whatever code a crafted file names. Here `.metadata` is unpickled by `_MetadataUnpickler`,
which admits only the types DCP writes into it (its metadata dataclasses, torch.Size, dtypes,
layouts, the memory-format enum, a path): the allow-list idea of torch.load(weights_only=True),
applied to DCP's metadata. Any other global is refused before anything of the file runs, with one
line naming the file and the object. The unpickled metadata is then checked for what this tool
writes: tensor entries only (a "bytes" entry would reach the unsafe torch.load), no stream
transforms, and every storage entry naming a file of the same directory that meta.json lists. The
shard files themselves are read by DCP with torch.load(weights_only=True).

`SafeReader` hands DCP the metadata read this way (its `read_metadata` takes no per-rank
argument, so DCP never falls back to another metadata file), and `load_state` gathers a
checkpoint's tensors without a process group (export, sample, eval, model.init_from).
"""
from __future__ import annotations

import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Iterable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import filesystem as dcp_fs

METADATA = ".metadata"

# (module, name) -> object: every global that torch.distributed.checkpoint's `.metadata` of a
# tensors-only state dict names. BytesStorageMetadata is left out on purpose: this tool saves
# tensors only, and a bytes entry is read with an unrestricted torch.load.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n): getattr(dcp_md, n)
    for n in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
              "StorageMeta", "_MEM_FORMAT_ENCODING")
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # name -> a torch.layout
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PosixPath  # the checkpoint id DCP records (a path, never opened)
_ALLOWED[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
_ALLOWED.update({("torch", n): getattr(torch, n) for n in dir(torch)
                 if isinstance(getattr(torch, n, None), torch.dtype)})


class MetadataError(ValueError):
    """A DCP `.metadata` this tool did not write; the message is one line naming the file."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: Path) -> None:
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise MetadataError(f"{self.path}: refused to load: DCP metadata may hold only the types "
                                f"torch.distributed.checkpoint writes, and this file names the Python object "
                                f"{module}.{name}; nothing of it was run. It was not written by this tool, or was "
                                f"altered after") from None

    def persistent_load(self, pid):
        raise MetadataError(f"{self.path}: refused to load: it holds a persistent reference, which DCP metadata "
                            f"never does; nothing of it was run")


def read_metadata(dcp_dir: Path, listed: Iterable[str]) -> dcp_md.Metadata:
    """The DCP metadata of `dcp_dir`, unpickled through the allow-list and checked (module
    docstring). `listed`: the names (relative to `dcp_dir`) meta.json lists there. MetadataError
    (one line, naming the file) for anything else."""
    path = Path(dcp_dir) / METADATA
    listed = set(listed)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except MetadataError:
        raise
    except FileNotFoundError:
        raise MetadataError(f"{path} is missing") from None
    except Exception as e:  # noqa: BLE001 - every failure of an untrusted file becomes one line
        raise MetadataError(f"{path} is unreadable, truncated or corrupt ({type(e).__name__}: "
                            f"{str(e).strip()[:200]})") from None
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise MetadataError(f"{path} does not hold DCP metadata (got {type(md).__name__})")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, dcp_md.TensorStorageMetadata):
            raise MetadataError(f"{path}: entry {key!r} is a {type(entry).__name__}, not a tensor; this tool "
                                f"saves tensors only")
    for index, info in md.storage_data.items():
        if not isinstance(index, dcp_md.MetadataIndex) or not isinstance(info, dcp_fs._StorageInfo):
            raise MetadataError(f"{path}: storage entry {index!r} is not DCP's")
        if info.transform_descriptors:
            raise MetadataError(f"{path}: storage entry {index.fqn!r} asks for stream transforms "
                                f"{info.transform_descriptors}, which this tool never writes")
        name = info.relative_path
        if not isinstance(name, str) or name not in listed or "/" in name or name.startswith("."):
            raise MetadataError(f"{path}: storage entry {index.fqn!r} points at {name!r}, not a shard file "
                                f"listed in the checkpoint's meta.json")
    planner = md.planner_data if md.planner_data is not None else {}
    if not isinstance(planner, dict) or not all(
            isinstance(k, str) and isinstance(v, tuple) and all(isinstance(x, (str, int)) for x in v)
            for k, v in planner.items()):
        raise MetadataError(f"{path}: its planner data is not DCP's key paths")
    return md


class SafeReader(FileSystemReader):
    """DCP's file-system reader with metadata read by `read_metadata` beforehand."""

    def __init__(self, dcp_dir: Path, metadata: dcp_md.Metadata) -> None:
        super().__init__(str(dcp_dir))
        self._metadata = metadata

    def read_metadata(self) -> dcp_md.Metadata:  # no **kwargs: DCP then never tries a per-rank file
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_md.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def load_state(dcp_dir: Path, listed: Iterable[str]) -> dict:
    """Every tensor of DCP checkpoint `dcp_dir`, whole, in the nested layout it was saved with
    (no process group needed)."""
    # what DCP's own dcp_to_torch_save does, with our reader: the planner fills `state` with every
    # entry of the metadata (dcp.load would copy the empty dict and fill the copy)
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    md = read_metadata(dcp_dir, listed)
    state: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(state, storage_reader=SafeReader(dcp_dir, md), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return state


__all__ = ["METADATA", "MetadataError", "SafeReader", "load_state", "read_metadata"]
