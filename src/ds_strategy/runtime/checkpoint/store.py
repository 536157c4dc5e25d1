"""Finding a checkpoint on disk: the tag directory, its meta.pt, and every file it lists, checked up front.

[Note: publishing a tag]
Ranks write into a staging directory ``SAVE_DIR/.<tag>.partial``. Once every rank has finished, rank 0
writes ``meta.pt`` (the last file; it records the size of every other file) and renames the staging
directory to ``SAVE_DIR/<tag>``; only then does it rewrite ``latest``. So a tag directory that exists is
complete, and ``latest`` never names an incomplete one. Re-saving an existing tag renames the old
directory to ``.<tag>.replaced`` first and deletes it after the swap; a process killed between the two
renames leaves the old copy there, and ``resolve`` falls back to it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from ..layout import FlatLayout
from ..zero import Collectives
from .format import (
    LATEST,
    META,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    expect_format,
    fsync_dir,
    pause_for_tests,
    rank_file,
    ranks,
    read,
)
from .frozen import check_rank_file as check_frozen_partitions
from .sync import agree, gather

_REQUIRED_META = ("stage", "world_size", "groups", "module_entries", "state_keys", "files", "counters")


def staging_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.partial"


def replaced_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.replaced"


def check_tag(tag: str) -> str:
    if not tag or tag.startswith(".") or "/" in tag or "\\" in tag or tag == LATEST or tag.strip() != tag:
        raise CheckpointError(
            f"checkpoint tag {tag!r} cannot name a directory: use a non-empty name without '/', leading '.' or "
            f"surrounding spaces, other than {LATEST!r}"
        )
    return tag


def publish(staging: Path, final: Path) -> None:
    """Move a finished staging directory into place (see [Note: publishing a tag])."""
    old = replaced_dir(final.parent, final.name)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        pause_for_tests(f"{final.name} (between renames)")
    os.rename(staging, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def publish_with_meta(
    meta: dict[str, Any], sizes: list[dict[str, int]], staging: Path, final: Path, meta_name: str, *, save_latest: bool
) -> None:
    """Rank 0's end of a save: every rank's file sizes into ``meta``, ``meta`` written last into the staging
    directory, the tag moved into place (``publish``) and ``latest`` pointed at it atomically."""
    for s in sizes:
        meta["files"].update(s)
    atomic_save(meta, staging / meta_name)
    publish(staging, final)
    if save_latest:
        atomic_write_text(final.name, final.parent / LATEST)


def adopt_node_local(staging: Path, final: Path, *, rank: int, local_rank: int) -> None:
    """After rank 0 published: a node saving to its own disk still has its staging directory (rank 0
    published on another filesystem); its files move under the tag, where copying them to rank 0's directory
    completes it."""
    if rank != 0 and local_rank == 0 and staging.is_dir():
        final.mkdir(parents=True, exist_ok=True)
        for f in staging.iterdir():
            os.replace(f, final / f.name)
        shutil.rmtree(staging, ignore_errors=True)
        fsync_dir(final)


def write_tag(
    coll: Collectives,
    root: Path,
    name: str,
    write: Callable[[Path], dict[str, int]],
    meta: dict[str, Any] | None,
    meta_name: str,
    *,
    rank: int,
    local_rank: int,
    save_latest: bool,
) -> Path:
    """Every rank's part of saving tag ``name`` under ``root`` (see [Note: publishing a tag]), each step agreed
    across the ranks of ``coll``: one rank per node clears the staging directory; every rank writes its files
    into it (``write(staging)`` returns their sizes by name); rank 0, the one holding ``meta``, writes
    ``meta_name`` last and moves the tag into place; a node saving to its own disk then moves its files under
    the tag (``adopt_node_local``). Returns the tag directory."""
    staging = staging_dir(root, name)

    def clean() -> None:
        if local_rank == 0:  # one rank per node: works whether or not the nodes share the filesystem
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)

    agree(coll, clean, "save_checkpoint (clearing the staging directory)")

    def write_files() -> dict[str, int]:
        staging.mkdir(parents=True, exist_ok=True)
        return write(staging)

    sizes = gather(coll, agree(coll, write_files, "save_checkpoint (writing)"))
    final = root / name

    def finish() -> None:
        if meta is not None:
            publish_with_meta(meta, sizes, staging, final, meta_name, save_latest=save_latest)

    agree(coll, finish, "save_checkpoint (publishing)")
    agree(
        coll,
        lambda: adopt_node_local(staging, final, rank=rank, local_rank=local_rank),
        "save_checkpoint (node-local files)",
    )
    return final


def tags_in(root: Path) -> list[str]:
    """Complete tags under ``root`` (directories holding meta.pt), sorted by modification time."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / META).is_file()]
    return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime)]


def resolve(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The tag directory to load; every way of pointing at the wrong place gets its own explanation."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        latest = root / LATEST
        if latest.is_file():
            tag = latest.read_text().strip()
            if not tag:
                raise CheckpointError(f"{latest} is empty; pass tag= explicitly (available: {tags_in(root)})")
        elif (root / META).is_file():
            raise CheckpointError(
                f"{root} is a tag directory (it holds {META}), one level too deep: pass its parent "
                f"{root.parent} as the checkpoint directory and tag={root.name!r}"
            )
        else:
            tags = tags_in(root)
            if tags:
                raise CheckpointError(f"{root} has no {LATEST!r} file; pass tag= one of {tags}")
            deeper = [p.name for p in root.iterdir() if p.is_dir() and ((p / LATEST).is_file() or tags_in(p))]
            if deeper:
                raise CheckpointError(
                    f"{root} holds no checkpoint tags but its subdirectories {deeper} do: pass "
                    f"{root / deeper[0]} as the checkpoint directory (one level deeper)"
                )
            raise CheckpointError(
                f"{root} holds no ds_strategy checkpoint: no {LATEST!r} file and no tag directory with {META}"
            )
    tag_dir = root / tag
    if not tag_dir.is_dir():
        fallback = replaced_dir(root, tag)
        if (fallback / META).is_file():
            return fallback  # killed between the two renames of a re-save: the old copy is complete
        raise CheckpointError(f"checkpoint tag {tag!r} not found in {root}; available tags: {tags_in(root)}")
    if not (tag_dir / META).is_file():
        if (tag_dir / "mp_rank_00_model_states.pt").is_file():
            raise CheckpointError(
                f"{tag_dir} is a DeepSpeed checkpoint; convert it with DeepSpeed's zero_to_fp32.py and load the "
                "resulting state dict into the module"
            )
        raise CheckpointError(
            f"{tag_dir} holds no {META}: it is not a ds_strategy checkpoint tag (a save that did not finish leaves "
            f"no tag directory at all)"
        )
    return tag_dir


def read_meta(tag_dir: Path) -> dict[str, Any]:
    """meta.pt, checked for its header and keys, after checking that every file it lists is whole."""
    path = tag_dir / META
    meta = expect_format(read(path), path)
    missing = [k for k in _REQUIRED_META if k not in meta]
    if missing:
        raise CheckpointError(f"{path} lacks the keys {missing}")
    for name, size in meta["files"].items():
        file = tag_dir / name
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint file {file} is missing (the checkpoint was written by {ranks(meta['world_size'])}; "
                "when several nodes saved to local disks, copy every node's files into this directory)"
            )
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint file {file} has {actual} bytes, {META} recorded {size}: it is truncated or was replaced"
            )
    return meta


def rank_reader(tag_dir: Path, meta: dict[str, Any], layouts: list[FlatLayout]) -> Callable[[int], dict[str, Any]]:
    """Lazy, validated access to saved rank files (memory-mapped: only the pages copied are read)."""

    frozen_layouts = [FlatLayout.from_dict(d) for d in meta.get("frozen_groups", [])]

    @cache
    def rank_data(r: int) -> dict[str, Any]:
        name = rank_file(r)
        path = tag_dir / name
        data = expect_format(read(path, expected_size=meta["files"].get(name), mmap=True), path)
        if data.get("rank") != r or len(data.get("groups", ())) != len(layouts):
            raise CheckpointError(
                f"{path} is rank {data.get('rank')}'s file with {len(data.get('groups', ()))} param groups; "
                f"expected rank {r} with {len(layouts)} (files of different checkpoints mixed?)"
            )
        for g, (group, layout) in enumerate(zip(data["groups"], layouts, strict=True)):
            for key, t in [("fp32", group["fp32"]), *((f"state.{k}", v) for k, v in group["state"].items())]:
                if t.numel() != layout.partition_numel:
                    raise CheckpointError(
                        f"{path}: group {g} {key} has {t.numel()} elements, the saved layout gives rank {r} "
                        f"{layout.partition_numel}"
                    )
        if frozen_layouts:
            check_frozen_partitions(data, frozen_layouts, str(path))
        return data

    return rank_data
