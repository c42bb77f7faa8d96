"""One CPU backend instance used from several threads (two engines in one process, a
server next to an offline run) gives each thread its own scratch: identical results."""

import threading

import torch

from pagedkv.attention import AttentionMetadata, get_backend


def test_cpu_backend_concurrent_prefill_identical():
    torch.manual_seed(0)
    b = get_backend("cpu")
    nb, bs, h, d = 64, 16, 3, 64
    cache = b.allocate_kv_cache(nb, bs, h, d, torch.float32)
    table = list(range(40, 59))  # 19 blocks for 300 tokens
    md = AttentionMetadata.build([300], [300], [table], bs)
    b.write_kv(cache, torch.randn(300, h, d), torch.randn(300, h, d), md.slot_mapping)
    queries = [torch.randn(300, 9, d) for _ in range(3)]
    want = [b.forward(q, cache, md, 0.125).clone() for q in queries]
    errs: list[float] = []

    def work(i: int) -> None:
        m = AttentionMetadata.build([300], [300], [table], bs)
        for _ in range(10):
            errs.append(float((b.forward(queries[i], cache, m, 0.125) - want[i]).abs().max()))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(errs) == 30 and max(errs) == 0.0
