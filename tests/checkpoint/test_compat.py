"""Old checkpoints against the machines loaded now: whether a recorded frame chain still fits them,
and whether a recorded frame has the shape a frame is rebuilt from."""

from __future__ import annotations

from typing import Any

import pytest
from conformance.harness import mk, write_machines

from mklang.checkpoint.compat import first_misfit, frame_shape_error, rebuild
from mklang.engine.frame import Frame
from mklang.errors import CheckpointError

# --- does a recorded frame chain fit the machines loaded now ------------------

PARENT = """
    machine parent
    entry pick
    budget 9
    context {{ xs: [1, 2] }}
    state pick {{
      structure "s"
      prompt "p"
      output o
      when "bad" repair 2 -> pick
      when "worse" repair 1 -> pick
      otherwise -> each
    }}
    state each {{
      {each}
      output o
      otherwise -> sub
    }}
    state sub {{
      call child
      output c
      otherwise -> END
    }}
"""

CHILD = """
    machine child
    entry t
    budget 3
    state t {
      structure "s"
      prompt "p"
      output o
      otherwise -> END
    }
"""


def _chain(tmp_path, each: str = 'sample 3\n      structure "s"\n      prompt "p"') -> list[Frame]:
    """A parent paused at its call state `sub`, and the child level it started."""
    parent = write_machines(tmp_path, PARENT.format(each=each), CHILD)
    child = write_machines(tmp_path, CHILD)
    top = Frame.start(parent)
    top.state = "sub"
    return [top, Frame.start(child)]


def test_a_chain_that_fits_its_machines_has_no_misfit_even_with_a_finished_innermost_level(tmp_path):
    chain = _chain(tmp_path)
    assert first_misfit(chain) is None
    chain[1].state = "END"
    assert first_misfit(chain) is None  # the parent completes the call on resume
    chain[0].repair_left[("pick", 0)] = 0
    chain[0].repair_left[("pick", 1)] = 1  # a counter anywhere in 0..repair fits
    assert first_misfit(chain) is None


def test_a_misfit_names_the_frame_by_depth_machine_and_state(tmp_path):
    chain = _chain(tmp_path)
    chain[1].state = "gone"
    path = tmp_path / "child.mk"
    assert first_misfit(chain) == f"frame 2 (child at gone): state 'gone' no longer exists in {path}"
    chain[1].state = "t"
    chain[0].state = "gone"
    assert first_misfit(chain) == f"frame 1 (parent at gone): state 'gone' no longer exists in {tmp_path / 'parent.mk'}"


def test_a_machine_without_a_file_is_named_by_its_name_in_a_misfit():
    frame = Frame.start(mk(CHILD))
    frame.state = "gone"
    assert first_misfit([frame]) == "frame 1 (child at gone): state 'gone' no longer exists in child"


def test_a_level_that_reached_end_with_a_deeper_frame_after_it_does_not_fit(tmp_path):
    chain = _chain(tmp_path)
    chain[0].state = "END"
    assert first_misfit(chain) == "frame 1 (parent at END): a sub-machine frame follows a level that reached END"


def test_visits_of_a_state_that_is_gone_name_the_first_such_state(tmp_path):
    chain = _chain(tmp_path)
    chain[1].visits = {"t": 1, "zeta": 1, "beta": 2}
    assert first_misfit(chain) == (
        f"frame 2 (child at t): visits state 'beta', which no longer exists in {tmp_path / 'child.mk'}"
    )


def test_repair_counters_must_match_the_repair_gates_and_stay_within_their_budget(tmp_path):
    where = f"in {tmp_path / 'parent.mk'}"
    chain = _chain(tmp_path)
    chain[0].repair_left[("pick", 2)] = 0
    assert first_misfit(chain) == (
        f"frame 1 (parent at sub): repair counter of gate 2 of 'pick', which is not a repair gate {where}"
    )
    chain = _chain(tmp_path)
    chain[0].repair_left[("pick", 0)] = 3
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter 3 of gate 0 of 'pick' is outside 0..2"
    chain[0].repair_left[("pick", 0)] = -1
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter -1 of gate 0 of 'pick' is outside 0..2"
    chain[0].repair_left[("pick", 0)] = 2
    chain[0].repair_left[("pick", 1)] = 2
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter 2 of gate 1 of 'pick' is outside 0..1"
    chain = _chain(tmp_path)
    del chain[0].repair_left[("pick", 0)]
    del chain[0].repair_left[("pick", 1)]
    assert first_misfit(chain) == f"frame 1 (parent at sub): no repair counter for gate 0 of 'pick' {where}"
    chain = _chain(tmp_path)
    del chain[0].repair_left[("pick", 1)]
    assert first_misfit(chain) == f"frame 1 (parent at sub): no repair counter for gate 1 of 'pick' {where}"


def test_the_first_repair_counter_in_gate_order_is_the_one_reported(tmp_path):
    chain = _chain(tmp_path)
    chain[0].repair_left = {("pick", 1): 5, ("pick", 0): 5}
    assert first_misfit(chain) == "frame 1 (parent at sub): repair counter 5 of gate 0 of 'pick' is outside 0..2"


def test_a_repair_counter_of_a_plain_gate_is_not_a_repair_gate(tmp_path):
    chain = _chain(tmp_path)
    chain[0].repair_left[("pick", 2)] = 0  # `otherwise -> each` is gate 2 and does not repair
    assert "which is not a repair gate" in (first_misfit(chain) or "")
    chain = _chain(tmp_path)
    chain[0].repair_left[("each", 0)] = 0
    assert "repair counter of gate 0 of 'each', which is not a repair gate" in (first_misfit(chain) or "")


def test_kept_fan_out_branches_need_a_fan_out_state_and_a_sample_index_within_it(tmp_path):
    chain = _chain(tmp_path)
    chain = chain[:1]
    chain[0].state = "each"
    branch = {"output": "x", "usage": {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}}
    chain[0].branches = {0: branch, 2: branch}
    assert first_misfit(chain) is None
    chain[0].branches = {3: branch}
    assert first_misfit(chain) == "frame 1 (parent at each): holds a fan-out branch outside the 3 samples of 'each'"
    chain[0].branches = {-1: branch}
    assert first_misfit(chain) == "frame 1 (parent at each): holds a fan-out branch outside the 3 samples of 'each'"
    chain[0].state = "pick"
    chain[0].branches = {0: branch}
    assert first_misfit(chain) == (
        f"frame 1 (parent at pick): holds finished fan-out branches, but 'pick' does not fan out "
        f"in {tmp_path / 'parent.mk'}"
    )


def test_branches_of_a_fan_out_over_a_list_are_not_bounded_by_a_sample_count(tmp_path):
    [top, _] = _chain(tmp_path, each='over xs\n      structure "s"\n      prompt "p"')
    top.state = "each"
    top.branches = {7: {"output": "x", "usage": {}}}
    assert first_misfit([top]) is None


def test_a_deeper_frame_hangs_only_off_a_plain_call_to_its_machine(tmp_path):
    chain = _chain(tmp_path)
    chain[0].state = "pick"
    assert first_misfit(chain) == (
        f"frame 1 (parent at pick): a sub-machine frame follows, but 'pick' is not a call state "
        f"in {tmp_path / 'parent.mk'}"
    )
    chain = _chain(tmp_path, each="over xs\n      call child")
    chain[0].state = "each"
    assert first_misfit(chain) == (
        "frame 1 (parent at each): a sub-machine frame follows, but 'each' fans out (fan-out branches never suspend)"
    )
    chain = _chain(tmp_path)
    other = write_machines(tmp_path, CHILD.replace("machine child", "machine other"))
    chain[1] = Frame.start(other)
    assert first_misfit(chain) == "frame 1 (parent at sub): calls 'child', but the next frame runs 'other'"


# --- the shape of a recorded frame -------------------------------------------


def _recorded() -> dict[str, Any]:
    return {**Frame.start(mk(CHILD)).to_json(), "path": "child.mk"}


def test_a_recorded_frame_of_the_right_shape_has_no_shape_error():
    assert frame_shape_error(_recorded()) is None


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ([], "a frame must be a JSON object, not list"),
        ("x", "a frame must be a JSON object, not str"),
        ({**_recorded(), "steps": -1}, "field steps: Input should be greater than or equal to 0"),
        ({**_recorded(), "usage": {"input_tokens": 2}}, "field usage.output_tokens: Field required"),
        ({**_recorded(), "path": None}, "field path: names no machine file to run"),
        ({**_recorded(), "sha256": "abc", "surprise": 1}, "field surprise: Extra inputs are not permitted"),
        ({**_recorded(), "repair_left": [["a", 0]]}, "field repair_left.0.2: Field required"),
    ],
)
def test_a_malformed_recorded_frame_says_which_field_and_why(frame, message):
    assert frame_shape_error(frame) == message


def test_a_frame_the_model_lets_through_but_cannot_rebuild_is_one_checkpoint_error():
    machine = mk(CHILD)
    assert rebuild(_recorded(), machine, "cp.json").state == "t"
    with pytest.raises(CheckpointError) as caught:
        rebuild({"machine": "child"}, machine, "cp.json")
    assert str(caught.value) == "cp.json: malformed frame: KeyError: 'state'"
    negative = {**_recorded(), "usage": {"input_tokens": -2, "output_tokens": 0, "cost_usd": 0.0}}
    with pytest.raises(CheckpointError) as caught:  # spend numbers are `Usage.from_json`'s to check
        rebuild(negative, machine, "cp.json")
    assert str(caught.value) == (
        "cp.json: malformed frame: ValueError: usage input_tokens is -2, not a count from 0 to 1,000,000,000,000,000"
    )
