"""A reducer's checkpoint format: `FORMAT` names the layout `GradientReducer.state_dict` writes, and
`migrate` turns any earlier layout into it, so loading reads one layout only.

Format 0 (no ``"format"`` key) named the adaptive modes ``dense``/``half``/``sparse``, held the
planner's numbers flat and its reports as positional tensors, and left out keys added later (their
defaults below). Format 1 held no costs of the device route's sparse steps (`Mode.DEVICE`), and
format 2 none of the low-rank steps (`Mode.LOW_RANK`): they start unmeasured. Format 3 did not
record the world size and settings the state was saved under (``"config"``, `ReducerConfig.recorded`):
its checkpoints load unchecked."""

from __future__ import annotations

from typing import Any

import torch

from sparsecomm.adaptive.config import AdaptiveConfig
from sparsecomm.adaptive.report import Report
from sparsecomm.errors import SparseCommError

FORMAT = 4
DEVICE_COSTS_1 = {"device_overhead_s": [], "device_bytes_per_nnz": AdaptiveConfig().first_bytes_per_nnz,
                  "device_fixed_bytes": 0.0, "host_memory": 1.0}
LOW_RANK_COSTS_2: dict[str, Any] = {"low_rank_step_s": []}
MODES_0 = {"dense": "fp32", "half": "fp16", "sparse": "sparse"}
COSTS_0 = {"compute_s": "compute_s", "throughput": "throughput", "half_throughput": "fp16_throughput",
           "dense_cost_s": "fp32_step_s", "half_cost_s": "fp16_step_s", "sparse_overhead_s": "sparse_overhead_s",
           "preferred_density": "preferred_density", "total_numel": "total_numel", "budget_numel": "budget_numel",
           "bytes_per_nnz": "bytes_per_nnz", "fixed_bytes": "fixed_bytes", "encode_per_byte": "encode_per_byte",
           "decode_per_byte": "decode_per_byte", "max_magnitude": "max_magnitude"}


OWNERS = {"topology": "HierarchicalReducer", "mesh": "FSDPCompression", "residuals": "FlatFSDPCompression"}
"""a key only one kind of checkpoint holds → the class whose `state_dict` wrote it (none of them: a
`GradientReducer`'s)"""


def check_owner(state: Any, owner: str) -> None:
    """Raise unless ``state`` is a checkpoint ``owner``'s `state_dict` wrote (each kind numbers its
    own formats, so a format alone does not tell)."""
    if not isinstance(state, dict):
        raise SparseCommError(f"a {owner} checkpoint is the dict its state_dict() returned, not {type(state).__name__}")
    writer = next((kind for key, kind in OWNERS.items() if key in state), "GradientReducer")
    if writer != owner:
        raise SparseCommError(f"this checkpoint is what {writer}.state_dict() wrote: load it with "
                              f"{writer}.load_state_dict, not {owner}'s")


def migrate(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in the current `FORMAT` (a new dict; the tensors are shared).

    Raises:
        SparseCommError: ``state`` is not a `GradientReducer`'s, or of a format this version cannot read."""
    check_owner(state, "GradientReducer")
    version = state.get("format", 0)
    if version not in range(FORMAT + 1):
        raise SparseCommError(f"this checkpoint has format {version}; this sparsecomm reads formats 0 to {FORMAT}")
    if version == 0:
        state = _from_0(state)
    for older, added in ((1, DEVICE_COSTS_1), (2, LOW_RANK_COSTS_2)):
        if state["format"] == older:
            state = _with_costs(state, added, older + 1)
    if state["format"] == 3:
        state = {**state, "format": 4, "config": None}
    return state


def _with_costs(state: dict[str, Any], added: dict[str, Any], version: int) -> dict[str, Any]:
    """``state`` in format ``version``: its planner's costs with the ``added`` ones, unmeasured."""
    adaptive = state["adaptive"]
    if adaptive is not None:
        planner = adaptive["planner"]
        adaptive = {**adaptive, "planner": {**planner, "costs": {**added, **planner["costs"]}}}
    return {**state, "format": version, "adaptive": adaptive}


def _from_0(state: dict[str, Any]) -> dict[str, Any]:
    """A format-0 checkpoint in format 1."""
    pipeline = dict(state["pipeline"])
    pipeline["tensors"] = {key: {"density_share": 1.0, **saved} for key, saved in pipeline["tensors"].items()}
    session = {"split_points": [], **state["session"]}
    budget = state.get("budget")
    return {"format": 1, "pipeline": pipeline, "calls": state["calls"], "steps": state["steps"],
            "uncompressed": state["uncompressed"], "session": session,
            "bucket_orders": state.get("layouts", {}), "row_errors": state.get("row_errors", {}),
            "adaptive": None if budget is None else {"planner": _planner_0(budget),
                                                     "reports": _reports_0(state["reports"])}}


def _planner_0(budget: dict[str, Any]) -> dict[str, Any]:
    defaults: dict[str, list[float]] = {"half_throughput": [], "preferred_density": []}
    costs = {new: budget.get(old, defaults.get(old)) for old, new in COSTS_0.items()}
    trial = budget.get("trial")
    if trial is not None:
        trial = {"challenger": MODES_0[trial["challenger"]], "incumbent": MODES_0[trial["incumbent"]],
                 "to_run": [MODES_0[mode] for mode in trial["to_run"]],
                 "running": {step: [MODES_0[run[0]], run[1]] for step, run in trial["running"].items()},
                 "costs": {step: [MODES_0[cost[0]], cost[1]] for step, cost in trial["costs"].items()},
                 "last_step": trial["last_step"]}
    incumbent, rematch = budget.get("incumbent"), budget.get("rematch")
    # pairs were kept in name order, which is the modes' order of exactness: the ratios keep their sense
    trials = {"incumbent": None if incumbent is None else MODES_0[incumbent], "trial": trial,
              "last_trial": {MODES_0[mode]: step for mode, step in budget.get("last_trial", {}).items()},
              "rematch": None if rematch is None else MODES_0[rematch],
              "pair_ratios": [[MODES_0[first], MODES_0[second], ratios]
                              for first, second, ratios in budget.get("pair_ratios", [])]}
    return {"step": budget["step"], "costs": costs, "trials": trials, "last_compute_s": budget["last_compute_s"],
            "sparse_steps": budget["sparse_steps"], "reports_read": budget["reports_read"],
            "mode": MODES_0[budget.get("mode", "dense")],
            "mode_steps": {MODES_0[mode]: count for mode, count in budget.get("mode_steps", {}).items()}}


def _reports_0(reports: Any) -> dict[str, Any]:
    """Reports held as tensors of numbers in `Report`'s field order; an agreed throughput that is
    not a positive finite number held no measurement (it was kept negated, +inf unmeasured)."""
    if isinstance(reports, list):  # the agreed ones alone
        reports = {"held": None, "agreed": reports}

    def named(numbers: torch.Tensor) -> dict[str, float]:
        return Report.from_numbers(numbers).to_dict()  # a Report keeps a throughput only where it is one

    held = reports.get("held")
    return {"held": None if held is None else {"step": held[0], "report": named(held[1]), "needed": held[2]},
            "agreed": [{"step": step, "report": named(numbers)} for step, numbers in reports.get("agreed", [])]}
