"""Bad input to the public functions of the core modules is refused with one sentence.

Each row: a call a learner might make, the error it must raise (ValueError or TypeError, never a
raw AttributeError or ZeroDivisionError from deep inside, a hang, or a silent wrong result), and
words its message must hold. Every refusal happens before a rank communicates, so no rank is
started: calls that need a process group get torch's fake one (one process, world size 4), in
which a collective that was not refused "succeeds" without a word and so fails its row.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import distlab
from distlab import collectives as C
from distlab import data_parallel as DP
from distlab import layout as L
from distlab import mesh as M
from distlab import sharding as S
from distlab.launch import _check_arguments

from bad_input_tables import (WORLD, assert_refused_in_one_sentence,  # noqa: F401
                              fake_world, params)


def hello(rank, world_size):
    return rank


def t3():
    return torch.ones(3)


# (id, call, error type, words its message must contain, needs a process group)
CASES = [
    # ---- launch: all refused before any rank starts
    ("run-world-0", lambda: distlab.run(hello, 0), ValueError, ["world_size", "at least 1"], False),
    ("run-world-negative", lambda: distlab.run(hello, -1), ValueError, ["at least 1"], False),
    ("run-world-huge", lambda: distlab.run(hello, 10_000), ValueError, ["too many", "at most"], False),
    ("run-world-float", lambda: distlab.run(hello, 2.5), TypeError, ["whole number"], False),
    ("run-world-str", lambda: distlab.run(hello, "4"), TypeError, ["whole number"], False),
    ("run-world-bool", lambda: distlab.run(hello, True), TypeError, ["whole number"], False),
    ("run-not-a-function", lambda: distlab.run(42, 2), TypeError, ["function", "without calling"], False),
    ("run-called-function", lambda: distlab.run(hello(0, 1), 2), TypeError, ["function"], False),
    ("run-timeout-negative", lambda: distlab.run(hello, 2, timeout=-1), ValueError, ["timeout", "positive"], False),
    ("run-timeout-nan", lambda: distlab.run(hello, 2, timeout=math.nan), ValueError, ["timeout"], False),
    ("run-backend", lambda: distlab.run(hello, 2, backend="mpi"), ValueError, ["backend", "gloo"], False),
    ("run-threads-0", lambda: distlab.run(hello, 2, threads=0), ValueError, ["threads", "positive"], False),
    ("run-init-str", lambda: distlab.run(hello, 2, init="yes"), TypeError, ["init", "True or False"], False),
    ("run-env-value", lambda: distlab.run(hello, 2, env={"A": 1}), TypeError, ["env", "string"], False),
    ("run-env-list", lambda: distlab.run(hello, 2, env=["A=1"]), TypeError, ["env", "dict"], False),
    ("run-env-str", lambda: distlab.run(hello, 2, env="A=1"), TypeError, ["env", "dict"], False),
    ("run-emulate", lambda: distlab.run(hello, 2, emulate="tpu-9000"), ValueError, ["preset"], False),
    # ---- collectives
    ("coll-no-process-group", lambda: C.ring_all_reduce(t3()), ValueError, ["process group", "distlab.run"], False),
    ("coll-list", lambda: C.ring_all_reduce([1, 2, 3]), TypeError, ["torch.tensor", "list"], True),
    ("coll-op", lambda: C.ring_all_reduce(t3(), op="avg"), ValueError, ["op must be one of"], True),
    ("coll-op-unhashable", lambda: C.ring_all_reduce(t3(), op=["sum"]), ValueError, ["op must be one of"], True),
    ("coll-mean-of-ints", lambda: C.ring_all_reduce(torch.ones(3, dtype=torch.int64), op="mean"),
     TypeError, ["floating-point"], True),
    ("coll-reduce-scatter-str", lambda: C.ring_reduce_scatter("x"), TypeError, ["torch.tensor", "str"], True),
    ("coll-all-gather-numpy", lambda: C.ring_all_gather(np.ones(3)), TypeError, ["torch.tensor", "as_tensor"], True),
    ("coll-broadcast-list", lambda: C.tree_broadcast([1.0], src=0), TypeError, ["torch.tensor"], True),
    ("coll-broadcast-src", lambda: C.tree_broadcast(t3(), src=WORLD), ValueError, ["src", f"0 to {WORLD - 1}"], True),
    ("coll-broadcast-src-float", lambda: C.tree_broadcast(t3(), src=1.0), ValueError, ["src"], True),
    ("coll-naive-root", lambda: C.naive_all_reduce(t3(), root=-1), ValueError, ["root"], True),
    ("coll-a2a-count", lambda: C.all_to_all([t3()] * 3, [t3()] * 3), ValueError, ["one input and one output"], True),
    ("coll-a2a-not-tensors", lambda: C.all_to_all([1] * WORLD, [2] * WORLD), TypeError, ["torch.tensor"], True),
    ("coll-a2a-not-a-list", lambda: C.all_to_all(t3(), t3()), TypeError, ["list of tensors"], True),
    ("coll-a2a-own-shape", lambda: C.all_to_all([t3()] * WORLD, [torch.ones(1)] * WORLD),
     ValueError, ["same shape and dtype"], True),
    ("coll-a2a-own-dtype", lambda: C.all_to_all([t3()] * WORLD, [torch.ones(3, dtype=torch.int64)] * WORLD),
     ValueError, ["same shape and dtype"], True),
    # ---- mesh
    ("mesh-shape-none", lambda: M.check_mesh(None), ValueError, ["mesh shape", "(2, 4)"], False),
    ("mesh-shape-zero", lambda: M.check_mesh((2, 0)), ValueError, ["positive whole numbers"], False),
    ("mesh-shape-float", lambda: M.check_mesh((2, 2.0)), ValueError, ["whole numbers"], False),
    ("mesh-names-int", lambda: M.check_mesh((2, 2), 5), ValueError, ["names", "strings"], False),
    ("mesh-names-not-str", lambda: M.check_mesh((2, 2), (1, 2)), ValueError, ["strings"], False),
    ("mesh-names-count", lambda: M.check_mesh((2, 2), ("dp",)), ValueError, ["one per dimension"], False),
    ("mesh-names-twice", lambda: M.check_mesh((2, 2), ("dp", "dp")), ValueError, ["different"], False),
    ("mesh-world", lambda: M.check_mesh((2, 2), ("dp", "tp"), world_size=8), ValueError, ["must equal"], False),
    ("mesh-coordinate-out", lambda: M.coordinate(4, (2, 2)), ValueError, ["not in a mesh", "0 to 3"], False),
    ("mesh-coordinate-float", lambda: M.coordinate(1.5, (2, 2)), ValueError, ["not in a mesh"], False),
    ("mesh-coordinate-str", lambda: M.coordinate("1", (2, 2)), ValueError, ["'1'", "not in a mesh"], False),
    ("mesh-rank-at-outside", lambda: M.rank_at((2, 0), (2, 2)), ValueError, ["coordinate", "size - 1"], False),
    ("mesh-rank-at-short", lambda: M.rank_at((0,), (2, 2)), ValueError, ["2 whole number"], False),
    ("mesh-peers-dim-name", lambda: M.peers(0, (2, 2), "pp", ("dp", "tp")), ValueError, ["no dimension 'pp'"], False),
    ("mesh-peers-dim-index", lambda: M.peers(0, (2, 2), 2), ValueError, ["no dimension 2"], False),
    ("mesh-peers-dim-float", lambda: M.peers(0, (2, 2), 1.5), ValueError, ["name", "index"], False),
    ("mesh-groups-dim-none", lambda: M.groups_along((2, 2), None), ValueError, ["name", "index"], False),
    ("mesh-hand-world", lambda: M.HandMesh((2, 3), ("dp", "tp")), ValueError, ["6 ranks", f"is {WORLD}"], True),
    ("mesh-device-world", lambda: M.device_mesh((3,), ("dp",)), ValueError, ["3 ranks", "must equal"], True),
    # ---- data parallel
    ("dp-shard-rank-out", lambda: DP.shard_batch(torch.ones(4), 2, 2), ValueError, ["rank", "0..world_size-1"], False),
    ("dp-shard-rank-negative", lambda: DP.shard_batch(torch.ones(4), -1, 2), ValueError, ["rank"], False),
    ("dp-shard-world-0", lambda: DP.shard_batch(torch.ones(4), 0, 0), ValueError, ["world_size >= 1"], False),
    ("dp-shard-rank-float", lambda: DP.shard_batch(torch.ones(4), 0.5, 2), TypeError, ["whole number"], False),
    ("dp-shard-uneven", lambda: DP.shard_batch(torch.ones(5), 0, 2), ValueError, ["does not split evenly"], False),
    ("dp-bucketed-not-module", lambda: DP.BucketedDDP(lambda x: x), TypeError, ["torch.nn.module", "function"], True),
    ("dp-bucketed-cap-str", lambda: DP.BucketedDDP(nn.Linear(2, 2), bucket_cap_mb="25"), ValueError, ["bucket_cap_mb", "positive"], True),
    ("dp-bucketed-cap-0", lambda: DP.BucketedDDP(nn.Linear(2, 2), bucket_cap_mb=0), ValueError, ["bucket_cap_mb"], True),
    ("dp-average-not-module", lambda: DP.average_gradients("model"), TypeError, ["torch.nn.module"], True),
    ("dp-broadcast-src", lambda: DP.broadcast_parameters(nn.Linear(2, 2), src=WORLD), ValueError, ["src", "0 to"], True),
    ("dp-difference-no-params", lambda: DP.max_replica_difference(nn.ReLU()), ValueError, ["has none"], True),
    # ---- sharding (ZeRO)
    ("zero-bounds-world-0", lambda: S.chunk_bounds(10, 0, 0), ValueError, ["world_size >= 1"], False),
    ("zero-bounds-rank-out", lambda: S.chunk_bounds(10, 2, 2), ValueError, ["rank from 0"], False),
    ("zero-bounds-float", lambda: S.chunk_bounds(10.0, 2, 0), TypeError, ["whole numbers"], False),
    ("zero-stage", lambda: S.ZeRO(nn.Linear(2, 2), 4), ValueError, ["stage must be 1, 2 or 3"], True),
    ("zero-stage-bool", lambda: S.ZeRO(nn.Linear(2, 2), True), ValueError, ["stage must be 1, 2 or 3"], True),
    ("zero-not-module", lambda: S.ZeRO("model", 1), TypeError, ["torch.nn.module"], True),
    ("zero-nothing-to-train", lambda: S.ZeRO(nn.ReLU(), 1), ValueError, ["requires_grad"], True),
    ("zero-optimizer-name", lambda: S.ZeRO(nn.Linear(2, 2), 1, optimizer="adamw"), ValueError, ["optimizer_class"], True),
    ("zero-optimizer-whole-tensor", lambda: S.ZeRO(nn.Linear(2, 2), 1, optimizer_class=torch.optim.LBFGS),
     ValueError, ["every element"], True),
    ("zero-prefetch", lambda: S.ZeRO(nn.Linear(2, 2), 2, prefetch=True), ValueError, ["only stage 3"], True),
    ("zero-dtype", lambda: S.ZeRO(nn.Linear(2, 2), 1, compute_dtype=torch.int32), ValueError, ["compute_dtype"], True),
    # ---- layout
    ("layout-model", lambda: L.rank_layouts("GPT-9"), ValueError, ["unknown model"], False),
    ("layout-model-tuple", lambda: L.price((7e9, 32, 4096), 1, 1, 1), ValueError, ["(n_params, layers, hidden, heads)"], False),
    ("layout-nodes-0", lambda: L.rank_layouts("Llama-2 7B", nodes=0), ValueError, ["nodes", "at least 1"], False),
    ("layout-nodes-float", lambda: L.rank_layouts("Llama-2 7B", nodes=1.5), TypeError, ["nodes", "whole number"], False),
    ("layout-micro-batch-0", lambda: L.rank_layouts("Llama-2 7B", micro_batch=0), ValueError, ["micro_batch"], False),
    ("layout-cps-0", lambda: L.rank_layouts("Llama-2 7B", cps=(0,)), ValueError, ["cps"], False),
    ("layout-dp-0", lambda: L.price("Llama-2 7B", 0, 1, 8), ValueError, ["dp", "at least 1"], False),
    ("layout-tp-heads", lambda: L.price("Llama-2 7B", 1, 1, 3), ValueError, ["tp=3", "32 attention heads"], False),
    ("layout-cp-sequence", lambda: L.price("Llama-2 7B", 1, 1, 8, seq_len=4095, cp=2), ValueError, ["cp=2", "4095"], False),
    ("layout-value-bytes", lambda: L.price("Llama-2 7B", 1, 1, 8, value_bytes=3), ValueError, ["value_bytes"], False),
    ("layout-candidates-0", lambda: L.candidates(0, 8, 32, 32, 512, 1), ValueError, ["n_gpus"], False),
]


@pytest.mark.parametrize("call,error,words,needs_group", params(CASES))
def test_bad_input_is_refused_in_one_sentence(request, call, error, words, needs_group):
    assert_refused_in_one_sentence(request, call, error, words, needs_group)


def test_a_lambda_is_a_function_too():
    checked = _check_arguments(lambda rank, world_size: rank, 2, 30, None, True, None, None, False)
    assert checked[0] == 2


def test_what_is_allowed_still_works():
    """The checks refuse only what is wrong: numpy integers count, as torch's own APIs take them."""
    assert M.check_mesh((np.int64(2), 2), ("dp", "tp")) == ((2, 2), ("dp", "tp"))
    assert M.coordinate(np.int64(3), (2, 2)) == (1, 1)
    assert M.rank_at([1, 1], (2, 2)) == 3
    assert M.peers(0, (2, 2), np.int64(1)) == [0, 1]
    assert DP.shard_batch(torch.arange(4), np.int64(1), 2).tolist() == [2, 3]
    assert S.chunk_bounds(10, 4, 3) == (9, 10) and S.chunk_bounds(0, 2, 1) == (0, 0)
