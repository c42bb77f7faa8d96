"""Weight memory on 2 MiB pages (``pagedkv.ops.hugepages``): ``empty`` hands out aligned,
non-overlapping uint8 tensors in memory the kernel may back with transparent huge pages
(``THPeligible`` in ``/proc/self/smaps``), unmapped when the last view is gone; a GGUF's packed
matrices of a first load live there (a later load maps the packed store's file);
``PAGEDKV_HUGE_PAGES=0`` gives plain memory."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.model import gguf_native, packed_cache
from pagedkv.model.loader import load_model
from pagedkv.ops import hugepages

THP = hugepages.thp_mode()
ADVISED = THP in ("madvise", "always")


def _vma(addr: int) -> dict[str, object]:
    """The mapping of ``/proc/self/smaps`` holding ``addr``: its start, path and THPeligible."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = {"start": lo, "path": head[5] if len(head) > 5 else ""} if lo <= addr < hi else None
            elif found is not None and line.startswith("THPeligible:"):
                found["eligible"] = int(head[1])
                return found
    raise AssertionError(f"no mapping holds {addr:#x}")


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    p = tmp_path / "enabled"
    p.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(p)) == "madvise"
    p.write_text("[always] madvise never\n")
    assert hugepages.thp_mode(str(p)) == "always"
    assert hugepages.thp_mode(str(tmp_path / "absent")) == "unavailable"


def test_empty_gives_aligned_disjoint_tensors_in_advised_memory(monkeypatch):
    monkeypatch.delenv("PAGEDKV_HUGE_PAGES", raising=False)
    assert hugepages.enabled() == ADVISED
    small = [hugepages.empty(n) for n in (1, 100, 442_368, 4096)]
    for i, t in enumerate(small):
        assert t.dtype == torch.uint8 and t.numel() == (1, 100, 442_368, 4096)[i] and t.data_ptr() % 64 == 0
        t.fill_(i + 1)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in small)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
    assert [int(t[0]) for t in small] == [1, 2, 3, 4] and [int(t[-1]) for t in small] == [1, 2, 3, 4]
    big = hugepages.empty(hugepages.OWN_MAPPING + 12345)
    big[-1] = 7
    vma = _vma(big.data_ptr())
    if ADVISED:
        assert big.data_ptr() % hugepages.HUGE == 0 and vma["start"] == big.data_ptr()  # its own mapping
        assert vma["eligible"] == 1 and _vma(small[2].data_ptr())["eligible"] == 1
    if ADVISED:
        addr = big.data_ptr()
        del big, vma
        gc.collect()
        assert not _mapped(addr)  # unmapped with its last view
    with pytest.raises(ValueError):
        hugepages.empty(-1)


def test_the_mappings_on_any_host(monkeypatch):
    """The mapping code itself (THP forced on: on a host without it the advice is simply refused):
    2 MiB-aligned own mappings, region cuts, unmapped with the last view, kept while a cut lives."""
    monkeypatch.delenv("PAGEDKV_HUGE_PAGES", raising=False)
    monkeypatch.setattr(hugepages, "thp_mode", lambda path=hugepages.THP_ENABLED: "madvise")
    monkeypatch.setattr(hugepages, "_regions", hugepages._Regions())
    big = hugepages.zeros(3 * hugepages.HUGE + 5)
    assert big.data_ptr() % hugepages.HUGE == 0 and big.numel() == 3 * hugepages.HUGE + 5 and int(big.count_nonzero()) == 0
    cut = hugepages.empty(1000)
    cut.fill_(9)
    region_start = hugepages._regions.region.data_ptr()
    assert region_start % hugepages.HUGE == 0 and cut.data_ptr() == region_start
    addr = big.data_ptr()
    del big
    gc.collect()
    assert not _mapped(addr)
    hugepages._regions.region = None  # the allocator lets go of its region: the cut still holds it
    gc.collect()
    assert _mapped(region_start) and int(cut.sum()) == 9000
    del cut
    gc.collect()
    assert not _mapped(region_start)


def test_switched_off_it_is_plain_torch_memory(monkeypatch):
    monkeypatch.setenv("PAGEDKV_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    t = hugepages.empty(hugepages.OWN_MAPPING)
    t.fill_(1)
    # torch's allocator (glibc: a 64-byte aligned chunk after malloc's header), not a mapping of
    # this module's (2 MiB aligned). Not checked through THPeligible, which read 1 for such a
    # chunk in some pytest-xdist runs: where glibc puts it is not this module's doing
    assert t.data_ptr() % hugepages.HUGE != 0 and t.untyped_storage().nbytes() == hugepages.OWN_MAPPING
    for bad in ("yes", "2", ""):  # like the other on/off switches: 0, 1 or unset
        monkeypatch.setenv("PAGEDKV_HUGE_PAGES", bad)
        with pytest.raises(ConfigError, match="PAGEDKV_HUGE_PAGES"):
            hugepages.empty(1 << 20)


@pytest.fixture(scope="module")
def stored(bundled_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("huge")
    lm = load_model(bundled_gguf, weights="gguf", cache_dir=root)
    packed_cache.wait_for_writes()
    return lm, root


def _head(lm) -> gguf_native.GGUFLinear:
    return dict(lm.model.named_modules())["lm_head"]


def test_a_first_load_packs_into_advised_memory_and_the_store_maps_the_same_bytes(stored, bundled_gguf, monkeypatch):
    monkeypatch.delenv("PAGEDKV_HUGE_PAGES", raising=False)
    first, root = stored
    assert first.report.packed_from_cache == 0
    mods = dict(first.model.named_modules())
    for name in ("lm_head", "layers.29.down_proj"):  # the 30 MB Q8_0 head on its own mapping, 1.7 MB cut from a region
        vma = _vma(mods[name].packed.codes.data_ptr())
        assert vma["path"] == "" and vma["eligible"] == int(ADVISED), (name, vma)
    again = load_model(bundled_gguf, weights="gguf", cache_dir=root)
    assert again.report.packed_from_cache == 121
    vma = _vma(_head(again).packed.codes.data_ptr())
    assert vma["path"].endswith(".bin") and "packed" in vma["path"]  # the store's file: its page cache shared
    assert torch.equal(_head(again).packed.codes, _head(first).packed.codes)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_head(again)(x), _head(first)(x))


def test_switched_off_a_first_load_packs_into_plain_memory(bundled_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_HUGE_PAGES", "0")
    lm = load_model(bundled_gguf, weights="gguf", cache_dir=tmp_path, use_cache=False)
    small = dict(lm.model.named_modules())["layers.29.down_proj"].packed.codes  # 1.7 MB: below the packer's own advice
    vma = _vma(small.data_ptr())
    # plain process memory: an anonymous mapping, or the brk heap where glibc's malloc, whose
    # mmap threshold grows with the process's earlier frees, served it from there
    assert vma["path"] in ("", "[heap]") and vma["eligible"] == int(THP == "always"), vma


def test_a_cpu_kv_cache_is_zero_on_its_own_advised_mapping(monkeypatch):
    from pagedkv.attention.layouts import lazy_zeros

    monkeypatch.delenv("PAGEDKV_HUGE_PAGES", raising=False)
    shape = (256, 16, 4, 64)  # 256 blocks of 16 tokens, 4 KV heads of 64: 4 MiB of fp32 a tensor (2 huge pages)
    k = lazy_zeros(shape, torch.float32)
    assert tuple(k.shape) == shape and k.dtype == torch.float32 and int(k.count_nonzero()) == 0
    k[5, 3, 1, 7] = 2.5
    vma = _vma(k.data_ptr())
    assert (vma["eligible"], vma["start"] == k.data_ptr()) == ((1, True) if ADVISED else (vma["eligible"], False))
    monkeypatch.setenv("PAGEDKV_HUGE_PAGES", "0")
    plain = lazy_zeros(shape, torch.float32)
    # plain memory: not advised (its mapping's start is the allocator's business: a fresh clone's
    # run once found it at a mapping's first byte, after earlier frees)
    assert int(plain.count_nonzero()) == 0 and (THP != "madvise" or _vma(plain.data_ptr())["eligible"] == 0)
