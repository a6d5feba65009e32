"""What the demo reads of Kubernetes' work: which pods moved where (from listings), and the PDBs' lowest health."""

from __future__ import annotations

from typing import Any

from pipeline.demo.observed import HEALTHY, Budgets, PodMoves

A, B, C = "gpu-a", "gpu-b", "gpu-c"
SET = "llm-train"
DEP = "llm-eval"


def pod(name: str, uid: str, node: str | None, *, app: str = SET, owner: str = "StatefulSet", phase: str = "Running",
        deleting: bool = False) -> dict[str, Any]:
    """A pod as the API server lists it, running and ready where ``phase`` is Running."""
    meta: dict[str, Any] = {"name": name, "uid": uid, "labels": {"app": app},
                            "ownerReferences": [{"kind": owner, "name": app}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-28T13:00:00Z"
    conditions = [{"type": "Ready", "status": "True"}] if phase == "Running" else []
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "conditions": conditions}}


def states(**quarantined: str) -> dict[str, str]:
    return {n: HEALTHY for n in (A, B, C)} | {k.replace("_", "-"): v for k, v in quarantined.items()}


FLEET = [pod("llm-train-0", "u0", A), pod("llm-train-1", "u1", B),
         pod("llm-eval-x-aaaaa", "e0", A, app=DEP, owner="ReplicaSet")]


def test_the_first_listing_is_the_fleet_as_it_started_nothing_moved() -> None:
    moves = PodMoves()
    moves.observe(FLEET, states(), 0)
    moves.observe(FLEET, states(), 1)
    assert moves.moves == []


def test_a_statefulset_pod_comes_back_under_its_name_on_the_node_the_scheduler_chose() -> None:
    moves = PodMoves()
    moves.observe(FLEET, states(), 0)
    drained = states(gpu_b="Quarantined")
    # Evicted: being deleted counts as gone at once (KWOK finalises it; the listing may still show it).
    moves.observe([FLEET[0], pod("llm-train-1", "u1", B, deleting=True), FLEET[2]], drained, 1)
    (move,) = moves.moves
    assert (move.evicted, move.source, move.status) == ("llm-train-1", B, "not re-created")
    moves.observe([FLEET[0], pod("llm-train-1", "u1b", None, phase="Pending"), FLEET[2]], drained, 2)
    assert (move.pod, move.target, move.status) == ("llm-train-1", "", "Pending")
    moves.observe([FLEET[0], pod("llm-train-1", "u1b", C, phase="Pending"), FLEET[2]], drained, 3)
    moves.observe([FLEET[0], pod("llm-train-1", "u1b", C), FLEET[2]], drained, 4)
    assert (move.target, move.target_state, move.placed_at, move.status, move.healthy) == (C, HEALTHY, 3, "Running",
                                                                                          True)


def test_a_replicaset_pod_is_replaced_under_a_new_name() -> None:
    moves = PodMoves()
    moves.observe(FLEET, states(), 0)
    moves.observe([*FLEET[:2], pod("llm-eval-x-bbbbb", "e1", C, app=DEP, owner="ReplicaSet")],
                  states(gpu_a="Quarantined"), 1)
    (move,) = moves.moves
    assert (move.owner, move.evicted, move.source, move.pod, move.target) == (
        "ReplicaSet", "llm-eval-x-aaaaa", A, "llm-eval-x-bbbbb", C)
    assert move.healthy


def test_a_replacement_is_paired_with_a_pod_of_its_own_workload() -> None:
    moves = PodMoves()
    moves.observe(FLEET, states(), 0)
    # Both of A's pods leave; the StatefulSet's new pod shows up first, then the ReplicaSet's.
    moves.observe([FLEET[1], pod("llm-train-0", "u0b", C)], states(gpu_a="Quarantined"), 1)
    moves.observe([FLEET[1], pod("llm-train-0", "u0b", C), pod("llm-eval-x-ccccc", "e2", B, app=DEP,
                                                               owner="ReplicaSet")], states(gpu_a="Quarantined"), 2)
    assert {(m.evicted, m.pod, m.target) for m in moves.moves} == {
        ("llm-train-0", "llm-train-0", C), ("llm-eval-x-aaaaa", "llm-eval-x-ccccc", B)}


def test_a_placement_on_a_node_out_of_service_at_both_ends_of_the_interval_counts_against_it() -> None:
    moves = PodMoves()
    moves.observe(FLEET, states(gpu_c="Quarantined"), 0)
    moves.observe([FLEET[0], FLEET[2]], states(gpu_b="Quarantined", gpu_c="Quarantined"), 1)
    moves.observe([FLEET[0], pod("llm-train-1", "u1b", C), FLEET[2]], states(gpu_b="Quarantined",
                                                                              gpu_c="Quarantined"), 2)
    (move,) = moves.moves
    assert move.running and move.target_state == "Quarantined" and not move.healthy


def test_a_node_in_service_at_the_start_of_the_interval_took_the_pod_in_service() -> None:
    """The scheduler bound it while the node was in service; the node was quarantined before the next look."""
    moves = PodMoves()
    moves.observe(FLEET, states(), 0)
    moves.observe([FLEET[0], FLEET[2]], states(gpu_b="Quarantined"), 1)
    moves.observe([FLEET[0], pod("llm-train-1", "u1b", C), FLEET[2]], states(gpu_b="Quarantined",
                                                                              gpu_c="Quarantined"), 2)
    assert moves.moves[0].healthy


def test_a_replacement_that_is_drained_in_turn_moves_again() -> None:
    moves = PodMoves()
    moves.observe(FLEET, states(), 0)
    moves.observe([FLEET[0], pod("llm-train-1", "u1b", C), FLEET[2]], states(gpu_b="Quarantined"), 1)
    moves.observe([FLEET[0], FLEET[2]], states(gpu_b="Quarantined", gpu_c="Quarantined"), 2)
    moves.observe([FLEET[0], pod("llm-train-1", "u1c", A), FLEET[2]], states(gpu_b="Quarantined",
                                                                              gpu_c="Quarantined"), 3)
    assert [(m.source, m.target, m.healthy) for m in moves.moves] == [(B, C, True), (C, A, True)]


def test_a_new_pod_nobody_left_room_for_is_no_move() -> None:
    moves = PodMoves()
    moves.observe(FLEET, states(), 0)
    moves.observe([*FLEET, pod("llm-train-2", "u2", C)], states(), 1)  # a scale-up
    assert moves.moves == []


def pdb(name: str, healthy: int, desired: int, generation: int | None = 1) -> dict[str, Any]:
    status = {"currentHealthy": healthy, "desiredHealthy": desired, "expectedPods": desired + 1}
    if generation is not None:
        status["observedGeneration"] = generation
    return {"metadata": {"name": name}, "status": status}


def test_budgets_keep_the_lowest_health_the_disruption_controller_reported() -> None:
    budgets = Budgets()
    budgets.observe({"metadata": {"name": SET}, "status": {}})  # created, not computed yet: not counted
    budgets.observe(pdb(SET, 0, 7, generation=None))
    assert not budgets.respected  # nothing seen is nothing proven
    for healthy in (8, 7, 8):
        budgets.observe(pdb(SET, healthy, 7))
    budgets.observe(pdb(DEP, 8, 7))
    assert budgets.respected
    train = budgets.by_name[SET]
    assert (train.lowest_healthy, train.desired_then, train.statuses, train.margin) == (7, 7, 3, 0)
    budgets.observe(pdb(DEP, 6, 7))
    assert not budgets.respected and budgets.by_name[DEP].margin == -1
