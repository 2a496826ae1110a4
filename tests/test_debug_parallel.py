"""Chapter 11 §2b: each detector of distlab.debug_parallel fires on its bug and stays silent on
the correct code, at two mesh shapes, and the correct code equals one process in float64."""
import pytest
import torch

import distlab
from distlab import debug_parallel as dbp
from distlab import expert_parallel as ep_lib

T = 120
STEPS = 2


# ---- the detectors alone -------------------------------------------------------------------------

def _detectors(rank, world_size):
    same = torch.arange(6.0)
    last_differs = torch.arange(6.0) + (rank == world_size - 1)
    zero = torch.zeros(3)
    first_and_last = torch.tensor([1.0, 2.0]) if rank in (0, world_size - 1) else \
        torch.tensor([float(rank), 9.0])
    swapped = torch.tensor([1.0, 2.0]) if rank else torch.tensor([2.0, 1.0])   # same plain sum
    named = [("same", same), ("last differs", last_differs), ("zero", zero),
             ("first and last", first_and_last), ("swapped", swapped)]
    return dbp.disagree(named), dbp.coincide(named)


def test_disagree_and_coincide_agree_on_every_rank():
    got = distlab.run(_detectors, 3, timeout=T)
    assert all(r == got[0] for r in got)
    disagree, coincide = got[0]
    assert disagree == ["last differs", "first and last", "swapped"]
    # ranks 0 and 1 hold the same "last differs", 1 and 2 the same "swapped"; zeros never count
    assert coincide == ["same", "last differs", "first and last", "swapped"]


# ---- tensor parallel: LayerNorm gradients not summed over tp ------------------------------------

UNSUMMED = dbp.sp_block_without_ln_sum()


def _both_blocks(rank, world_size):
    return [dbp.train_sequence_parallel(rank, world_size, block, steps=STEPS)
            for block in (dbp.ParallelBlock, UNSUMMED)]


@pytest.mark.parametrize("tp", [2, 3])
def test_unsummed_layernorm_gradients_drift_apart(tp):
    _, ref_losses = dbp.sequence_parallel_reference(STEPS)
    got = distlab.run(_both_blocks, tp, timeout=T)
    correct, broken = ([r[i] for r in got] for i in range(2))
    for r in correct:
        assert r["out_of_sync"] == [0] * STEPS
        assert r["diff"] < 1e-12
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-12)
    for r in broken:
        assert r["out_of_sync"] == [0] + [4] * (STEPS - 1)     # ln1, ln2: weight and bias
        assert r["diff"] > 1e-4
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-2)  # the loss does not tell


# ---- pipeline: groups built for the other mesh order --------------------------------------------

@pytest.mark.parametrize("dp, pp", [(2, 2), (2, 3)])
def test_pipeline_messages_that_leave_their_replica(dp, pp):
    _, ref_losses = dbp.pipeline_reference(dp, pp, STEPS)
    at = lambda r: divmod(r, pp)       # the job's mesh: stages fastest
    for order, buggy in (("dp, pp", False), ("pp, dp", True)):
        got = distlab.run(dbp.train_pipeline_dp, dp * pp, dp, pp, order, steps=STEPS,
                          trace=True, timeout=T)
        stray = dbp.stray_messages(got.trace, at)
        calls = dbp.p2p_count(got.trace)
        # per boundary and micro-batch: an activation and a gradient, each a send and a recv
        assert calls == dp * (pp - 1) * dbp.PIPE_MICRO * 4 * STEPS
        if buggy:
            assert len(stray) == calls
            assert all(r["diff"] > 1e-4 for r in got)
            losses = got[0]["losses"]
            assert losses[-1] < losses[0] < 2 * ref_losses[0]      # it trains, in range
        else:
            assert stray == []
            assert all(r["diff"] < 1e-12 for r in got)
            assert got[0]["losses"] == pytest.approx(ref_losses, rel=1e-12)


def test_one_replica_has_one_mesh_order():
    got = distlab.run(dbp.train_pipeline_dp, 3, 1, 3, "pp, dp", steps=1, trace=True, timeout=T)
    assert dbp.stray_messages(got.trace, lambda r: divmod(r, 3)) == []


def test_a_skipped_stage_and_a_crossing_are_told_apart():
    got = distlab.run(dbp.train_pipeline_dp, 6, 2, 3, "pp, dp", steps=1, trace=True, timeout=T)
    why = {(s["rank"], s["peer"]): s["why"] for s in dbp.stray_messages(got.trace,
                                                                       lambda r: divmod(r, 3))}
    assert why[(0, 2)] == ["not a neighbouring stage"]   # replica 0: stage 0 -> stage 2
    assert why[(2, 4)] == ["leaves its replica"]       # replica 0 stage 2 -> replica 1 stage 1


# ---- expert parallel: reduce_gradients with its groups swapped ----------------------------------

def _both_reductions(rank, world_size, dp, ep, n_experts):
    return [dbp.train_expert_dp(rank, world_size, dp, ep, reduce, steps=STEPS,
                                n_experts=n_experts)
            for reduce in (ep_lib.reduce_gradients, dbp.reduce_gradients_swapped)]


@pytest.mark.parametrize("dp, ep", [(2, 2), (1, 3)])
def test_swapped_groups_equal_experts_and_drifting_replicas(dp, ep):
    n_experts = 2 * ep
    _, ref_losses = dbp.expert_reference(dp * ep, STEPS, n_experts)
    got = distlab.run(_both_reductions, dp * ep, dp, ep, n_experts, timeout=T)
    correct, broken = ([r[i] for r in got] for i in range(2))
    for r in correct:
        assert r["replicated out of sync"] == r["experts out of sync"] == [0] * STEPS
        assert r["experts equal"] == [0] * STEPS
        assert r["diff"] < 1e-12
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-12)
    for r in broken:
        assert r["replicated out of sync"] == [8] * STEPS   # inp, norm, router, head
        assert r["experts equal"] == [8] * STEPS            # 2 local experts x 4 tensors
        assert r["experts out of sync"] == [0] * STEPS      # the dp check cannot see it
        assert r["diff"] > 1e-4
        assert r["losses"] == pytest.approx(ref_losses, rel=0.2)
