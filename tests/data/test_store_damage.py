"""A prepared store damaged after it was written is never used (issue 29): overwritten
token ids (sizes intact) and a truncated array are found when the store is opened; the
store is rebuilt from its sources (one process rebuilds, the others wait and use the
rebuilt one), and refused with its fix when opened directly."""
import os

import numpy as np
import pytest
from multirank import spawn

from megaft.data.prepare import prepare_dataset
from megaft.data.store import PreparedDataset, StoreDamagedError
from tests.data.test_prepare import setup  # noqa: F401  (the fixture: sources and a chat checkpoint)


def overwrite_ids(path: str) -> None:
    """Change some token ids in place, to in-vocabulary values: the size stays; only a checksum sees it."""
    tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=np.uint32, mode="r+")
    tokens[10:20] = (tokens[10:20] + 1) % 5
    tokens.flush()
    del tokens


def truncate(path: str) -> None:
    file = os.path.join(path, "target.bin")
    os.truncate(file, os.path.getsize(file) - 7)


def test_overwritten_ids_are_found_by_the_full_check_and_the_store_rebuilt(setup, caplog):  # noqa: F811
    cfg, ckpt, _ = setup
    ds = prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)
    good = np.array(ds.tokens)
    overwrite_ids(ds.path)
    # sizes alone cannot see it; the default (full) can, even though verified.json exists
    assert len(PreparedDataset(ds.path, verify="sizes")) == len(ds)
    with pytest.raises(StoreDamagedError, match="tokens.bin does not match its sha256") as info:
        PreparedDataset(ds.path)
    assert str(info.value).startswith(f"{ds.path}: the prepared dataset is damaged") and "fix:" in str(info.value)
    rebuilt = prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)
    assert rebuilt.path == ds.path and np.array_equal(np.array(rebuilt.tokens), good)
    assert "rebuilding it from the sources" in caplog.text


def test_a_truncated_array_or_an_id_outside_the_vocabulary_is_found_by_sizes(setup):  # noqa: F811
    cfg, ckpt, _ = setup
    ds = prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)
    with pytest.raises(StoreDamagedError, match="outside the tokenizer's vocabulary of 3"):
        PreparedDataset(ds.path, verify="sizes", vocab_size=3)
    truncate(ds.path)
    with pytest.raises(StoreDamagedError, match=r"target.bin has \d+ bytes, the manifest says \d+"):
        PreparedDataset(ds.path, verify="sizes")
    cfg.verify_store = "sizes"
    assert len(prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)) == len(ds)  # rebuilt


def _open_on_ranks(rank: int, world: int, cfg, ckpt, out: str) -> None:
    ds = prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)
    np.save(os.path.join(out, f"tokens_{rank}.npy"), np.array(ds.tokens))


def test_two_ranks_never_use_a_damaged_store(setup, tmp_path):  # noqa: F811
    cfg, ckpt, _ = setup
    ds = prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)
    good = np.array(ds.tokens)
    overwrite_ids(ds.path)
    spawn(2, _open_on_ranks, cfg, ckpt, str(tmp_path))
    for rank in range(2):  # both got the rebuilt store, neither the damaged one
        assert np.array_equal(np.load(tmp_path / f"tokens_{rank}.npy"), good)


def _agree_on_ranks(rank: int, world: int, cfgs, ckpt, out: str) -> None:
    from types import SimpleNamespace

    from megaft.data.errors import DataError
    from megaft.training.agreed import agreed_store

    grid = SimpleNamespace(rank=rank, world_size=world, device="cpu")
    try:
        agreed_store(cfgs[rank], grid, init_from=ckpt, eos_token_id=2)
        result = "ok"
    except DataError as exc:
        result = str(exc)
    with open(os.path.join(out, f"rank_{rank}.txt"), "w") as f:
        f.write(result)


def test_ranks_agree_on_the_store_before_training(setup, tmp_path):  # noqa: F811
    # same data: both open it; data that differs on one node: every rank refuses, none waits
    import copy

    cfg, ckpt, root = setup
    spawn(2, _agree_on_ranks, [cfg, cfg], ckpt, str(tmp_path))
    assert [open(tmp_path / f"rank_{r}.txt").read() for r in range(2)] == ["ok", "ok"]
    other = copy.deepcopy(cfg)
    changed = tmp_path / "changed.jsonl"
    changed.write_text(open(cfg.sources[0].path).read().replace("a", "b", 3))
    other.sources[0].path = str(changed)
    spawn(2, _agree_on_ranks, [cfg, other], ckpt, str(tmp_path))
    for r in range(2):
        assert "prepared datasets hold different tokens" in open(tmp_path / f"rank_{r}.txt").read()


def test_a_store_moved_aside_while_opening_sends_the_reader_to_the_lock(setup, monkeypatch):  # noqa: F811
    """Another rank, holding the lock, moves a damaged store aside between this rank's completeness
    check and its open (the manifest gone): this rank waits at the lock for the rebuild (None), it
    does not fail; holding the lock itself, the error stands."""
    from megaft.data import prepare as prep
    from megaft.data.errors import DataError

    cfg, ckpt, _ = setup
    ds = prepare_dataset(cfg, init_from=ckpt, eos_token_id=2, progress=False)
    os.remove(os.path.join(ds.path, "manifest.json"))  # what the other rank's rename leaves this one
    monkeypatch.setattr(prep, "is_complete", lambda path: True)  # it was complete at the check
    assert prep._open_verified(ds.path, "full", None) is None
    with pytest.raises(DataError, match="not a complete prepared dataset"):
        prep._open_verified(ds.path, "full", None, repair=True)
