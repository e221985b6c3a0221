"""The wire protocol contract: what the agent's builder emits, the service's schema accepts,
and the two definitions agree field by field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fp8guard import wire
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.schemas import EventIn, IngestBatchIn, StepIn, TensorDefIn, TensorStatsIn


def _sample() -> dict:
    values = np.arange(2 * 3 * 4, dtype="<f4").reshape(2, 3, 4)
    values[1, 0, 2] = np.nan
    values[0, 2, 1] = -np.inf
    return wire.make_batch(
        run_id="contract-run",
        rank=3,
        segment=1,
        tensors=[{"index": i, "name": f"t{i}", "module": "m", "role": "fwd_input", "format": "e4m3"}
                 for i in range(4)],
        steps=[{"step": 7, "time": 1.5, "loss": math.nan, "grad_norm": math.inf, "lr": -math.inf, "tokens": 9,
                "loss_fp8": 2.5, "loss_bf16": 2.4, "fp8_loss_gap": 0.1 / 2.4},
               {"step": 8, "loss": 2.0}],
        tensor_stats=[wire.tensor_stats_block(stats=["amax", "scale", "saturation"], steps=[7, 8], n_tensors=4,
                                              data=values.tobytes())],
        events=[{"kind": wire.EventKind.CHECKPOINT_SAVED, "step": 8, "time": 2.0, "data": {"path": "/x"}}],
    )


def test_builder_output_is_valid_json_and_accepted() -> None:
    payload = _sample()
    text = wire.dumps(payload)  # refuses bare NaN, so non-finite must already be strings
    parsed = IngestBatchIn.model_validate_json(text)
    batch = decode_batch(parsed)
    assert batch.rank == 3 and batch.segment == 1 and batch.num_samples == 8
    assert math.isnan(batch.steps[0].loss) and batch.steps[0].grad_norm == math.inf
    assert batch.steps[0].lr == -math.inf
    vals = batch.blocks[0].values
    assert vals.shape == (2, 3, 4) and math.isnan(vals[1, 0, 2]) and vals[0, 2, 1] == -np.inf
    assert batch.events[0].kind == "checkpoint_saved"
    assert (batch.steps[0].loss_fp8, batch.steps[0].loss_bf16) == (2.5, 2.4) and batch.steps[1].fp8_loss_gap is None


def test_field_sets_agree() -> None:
    payload = _sample()
    assert set(payload) == set(IngestBatchIn.model_fields)
    assert set(payload["tensors"][0]) == set(TensorDefIn.model_fields)
    assert set(payload["steps"][0]) == set(StepIn.model_fields)
    assert set(payload["tensor_stats"][0]) == set(TensorStatsIn.model_fields)
    assert set(payload["events"][0]) == set(EventIn.model_fields)
    assert wire.STEP_FIELDS == ("loss", "grad_norm", "lr", "loss_fp8", "loss_bf16", "fp8_loss_gap")
    assert {k.value for k in wire.EventKind} == set(EventIn.model_json_schema()["$defs"]["EventKind"]["enum"])


@pytest.mark.parametrize("value", [0.0, -1.5, 1e-45, 3.4e38, math.inf, -math.inf])
def test_float_encoding_round_trips(value: float) -> None:
    assert wire.decode_float(wire.encode_float(value)) == value
    assert json.loads(json.dumps(wire.encode_float(value))) == wire.encode_float(value)


def test_nan_encoding_round_trips_and_bad_strings_fail() -> None:
    assert math.isnan(wire.decode_float(wire.encode_float(math.nan)))
    with pytest.raises(ValueError, match="expected a number"):
        wire.decode_float("nan please")


def test_builder_checks_shapes_and_ids() -> None:
    with pytest.raises(ValueError, match="expected 48"):
        wire.tensor_stats_block(stats=["a", "b", "c"], steps=[1, 2], n_tensors=2, data=b"\0" * 4)
    with pytest.raises(ValueError, match="run_id"):
        wire.make_batch(run_id="has space")
    assert wire.decode_f32(wire.encode_f32(b"\x01\x02\x03\x04")) == b"\x01\x02\x03\x04"
    with pytest.raises(ValueError, match="invalid base64"):
        wire.decode_f32("@@@@")


def test_protocol_doc_names_every_field() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    for name in list(IngestBatchIn.model_fields) + list(TensorStatsIn.model_fields) + list(StepIn.model_fields):
        assert f"`{name}`" in doc, f"docs/protocol.md does not document `{name}`"
    for kind in wire.EventKind:
        assert f"`{kind.value}`" in doc


# -- the other direction: commands to the agent, acknowledgements back ------------------------


def test_command_round_trips_and_the_service_mirror_agrees() -> None:
    from fp8guard.service.schemas import CommandOut

    cmd = wire.Command(id=7, kind=wire.CommandKind.ROLLBACK, reason="loss spike", checkpoint_step=100,
                       skip_batches=250, lr_scale=0.5, lr_scale_steps=20, onset_step=140, spike_step=150)
    raw = json.loads(json.dumps(cmd.to_json()))
    assert wire.Command.from_json(raw) == cmd
    assert set(raw) == set(CommandOut.model_fields)
    assert CommandOut.model_validate(raw).model_dump(mode="json") == raw
    assert CommandOut.of(cmd).model_dump(mode="json") == raw
    fb = wire.Command(id=8, kind=wire.CommandKind.FALLBACK, modules=("blocks.0.fc",), escalation=True)
    assert wire.Command.from_json(json.loads(json.dumps(fb.to_json()))) == fb


@pytest.mark.parametrize("raw, field", [
    ({"id": 1, "kind": "explode"}, "kind"),
    ({"id": "1", "kind": "fallback"}, "id"),
    ({"id": 1, "kind": "rollback"}, "checkpoint_step"),
    ({"id": 1, "kind": "fallback", "modules": "all"}, "modules"),
    ({"id": 1, "kind": "rollback", "checkpoint_step": 3, "lr_scale": 0}, "lr_scale"),
])
def test_malformed_commands_name_their_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        wire.Command.from_json(raw)


def test_ack_round_trips_and_the_service_mirror_agrees() -> None:
    from fp8guard.service.schemas import CommandAckIn

    ack = wire.CommandAck(command_id=7, status=wire.AckStatus.FAILED, applied_step=12, error="no checkpoint")
    raw = json.loads(json.dumps(ack.to_json()))
    assert wire.CommandAck.from_json(raw) == ack
    assert set(raw) == set(CommandAckIn.model_fields)
    assert CommandAckIn.model_validate(raw).model_dump(mode="json") == raw
    with pytest.raises(ValueError, match="status"):
        wire.CommandAck.from_json({"command_id": 1, "status": "done"})


def test_kind_lists_agree_across_the_boundary() -> None:
    """One place defines each list; the service's action kinds and statuses extend the protocol's."""
    from fp8guard.service.kinds import COMMAND_ACTIONS, ActionKind, ActionStatus

    assert {str(k) for k in wire.CommandKind} == COMMAND_ACTIONS <= {str(k) for k in ActionKind}
    assert {str(s) for s in wire.AckStatus} <= {str(s) for s in ActionStatus}
    assert all(ActionKind(str(k)).is_command for k in wire.CommandKind)
    assert not ActionKind.PAGE.is_command and not ActionKind.ALERT.is_command


def test_agent_parses_what_the_service_sends() -> None:
    pytest.importorskip("torch")
    from fp8guard.agent.commands import parse_command
    from fp8guard.service.schemas import CommandOut

    cmd = wire.Command(id=3, kind=wire.CommandKind.PROMOTE, modules=("a", "b"))
    assert parse_command(json.loads(CommandOut.of(cmd).model_dump_json())) == cmd
