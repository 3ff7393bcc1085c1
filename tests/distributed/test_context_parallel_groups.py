"""flashattn_mps.distributed on 3 and 4 gloo processes (slow: a pool each): every method, causal
and not, both layouts, with options, against single-process flash_attention and float64."""

import pytest
from distributed_pool import Pool


@pytest.mark.slow
@pytest.mark.parametrize("size", [3, 4])
def test_three_and_four_processes(size):
    pool = Pool(size)
    try:
        for method in ("allgather", "ring", "ulysses"):
            for causal, layout in ((True, "zigzag"), (False, "contiguous")):
                heads = dict(hq=6, hkv=3) if size == 3 else dict(hq=8, hkv=4)
                pool.run("attention_case", method=method, layout=layout, causal=causal, dtype="float32", **heads)
        options = {"window": [7, 2], "softcap": 5.0, "alibi": True, "sinks": True}
        for method in ("allgather", "ring"):
            pool.run(
                "attention_case", method=method, layout="zigzag", causal=False, hkv=2, dtype="float32", options=options
            )
        pool.run("shard_case", layout="zigzag")
        pool.run("errors_case")
    finally:
        pool.close()
