"""flashattn_mps.distributed on a pool of two gloo processes (one per module: see
distributed_pool): the three methods x causal x both layouts, each with two of (Hkv = H, H/2, 1)
x (float32, bfloat16) in rotation, batch 1 or 2, forward and gradients; the options with allgather, ring and
ulysses; shard/unshard/positions; errors that raise on every rank instead of hanging; the
sharded-KV-cache merge; torch.compile(fullgraph=True). Each case runs on every rank against
single-process flash_attention over the whole sequence and the float64 reference
(distributed_cases)."""

import itertools

import pytest
from distributed_pool import Pool

from helpers import needs_torch_2_6

METHODS = ("allgather", "ring", "ulysses")
LAYOUTS = ("zigzag", "contiguous")
HEADS_AND_DTYPES = list(itertools.product((4, 2, 1), ("float32", "bfloat16")))


def _sampled_product():
    cases = []
    for i, (method, causal, layout) in enumerate(itertools.product(METHODS, (True, False), LAYOUTS)):
        for hkv, dtype in (HEADS_AND_DTYPES[(2 * i) % 6], HEADS_AND_DTYPES[(2 * i + 1) % 6]):
            if method == "ulysses" and hkv == 1:
                hkv = 2  # Hkv must split over the group; Hkv = 1 is the allgather and ring cases'
            cases.append(dict(method=method, causal=causal, layout=layout, hkv=hkv, dtype=dtype, b=1 + i % 2))
    return cases


ALL_OPTIONS = {"window": [5, 3], "softcap": 5.0, "alibi": True, "sinks": True}
CAUSAL_OPTIONS = {"window": [6, -1], "alibi": True, "sinks": True}
OPTION_CASES = [
    dict(method=method, layout="zigzag", causal=causal, hkv=2, dtype="float32", options=options)
    for method in METHODS
    for causal, options in ((False, ALL_OPTIONS), (True, CAUSAL_OPTIONS))
] + [
    dict(method="ring", layout="contiguous", causal=True, hkv=4, dtype="float32", options={"window": [3, -1]}),
    dict(method="ring", layout="zigzag", causal=True, hkv=1, dtype="bfloat16", options={"sinks": True}),
    dict(method="allgather", layout="zigzag", causal=True, hkv=2, dtype="float32", unbatched=True),
]


@pytest.fixture(scope="module")
def pool():
    pool = Pool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("case", _sampled_product(), ids=lambda c: "-".join(str(v) for v in c.values()))
def test_methods_layouts_gqa_dtypes(pool, case):
    pool.run("attention_case", **case)


@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: f"{c['method']}-{c['causal']}-{c.get('options')}")
def test_options(pool, case):
    pool.run("attention_case", **case)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_unshard_positions(pool, layout):
    pool.run("shard_case", layout=layout)


def test_errors_raise_on_every_rank_and_never_hang(pool):
    pool.run("errors_case")


def test_sharded_kv_cache_merges_by_lse(pool):
    pool.run("kvcache_case")


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_compile_fullgraph(pool, method):
    pool.run("compile_case", method=method)


def test_tiny_llama_trains_with_the_loss_of_one_process(pool):
    needs_torch_2_6("transformers")
    pool.run("llama_case", method="ring")


def test_loss_and_gradient_helpers(pool):
    pool.run("helpers_case")
