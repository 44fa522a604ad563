"""The cause vocabulary against the broker's source, the proto and the docs.

Read statically (with ast), so a raise added anywhere in broker/ is checked
without a test of its own: every domain error names a cause, and the cause's
documented status code is the one the error is sent with.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from kvbroker.broker import errors
from kvbroker.broker.channels import SESSION_END_CAUSES
from kvbroker.broker.status import STATUS_OF_ERROR
from kvbroker.common.causes import CAUSES, LEASE_ENDED, Cause
from kvbroker.common.model import RevokeCause

ROOT = Path(__file__).resolve().parents[2]
BROKER = sorted((ROOT / "broker").rglob("*.py"))
ERROR_CLASSES = {cls.__name__: cls for cls in STATUS_OF_ERROR}
NOT_ERRORS = {Cause.NO_HOLDER, Cause.BELOW_MIN}  # skipped_reason words, never an error


def _calls() -> list[tuple[str, ast.Call]]:
    out: list[tuple[str, ast.Call]] = []
    for path in BROKER:
        tree = ast.parse(path.read_text(), str(path))
        out += [(f"{path.name}:{node.lineno}", node) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    return out


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _cause_literal(node: ast.expr | None) -> Cause | None:
    """`Cause.X` written out, else None (a cause computed at run time)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Cause":
        return Cause[node.attr]
    return None


def _cause_arg(call: ast.Call, position: int) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == "cause"), None)


def _status_literal(node: ast.expr) -> str:
    """`grpc.StatusCode.X` -> "X"."""
    if isinstance(node, ast.Attribute) and _name(node.value) == "StatusCode":
        return node.attr
    return ""


def test_every_cause_is_described_with_a_real_status_code() -> None:
    assert set(CAUSES) == set(Cause)
    names = {code.name for code in grpc.StatusCode} - {"OK"}
    for cause, info in CAUSES.items():
        assert info.code in names or (cause in NOT_ERRORS and info.code == ""), cause
        assert info.meaning and info.action, cause
        assert cause.value == cause.value.lower() and " " not in cause.value


def test_lease_end_causes_are_the_revoke_causes_and_released() -> None:
    revoke_labels = [c.label for c in RevokeCause if c is not RevokeCause.NONE]
    assert [str(c) for c in LEASE_ENDED] == [*revoke_labels, "released"]
    for label in revoke_labels:
        assert Cause(label) in CAUSES


def test_every_domain_error_names_a_cause_sent_with_its_documented_code() -> None:
    checked = 0
    for where, call in _calls():
        cls = ERROR_CLASSES.get(_name(call.func))
        if cls is None or not call.args:
            continue
        checked += 1
        arg = _cause_arg(call, 1)
        if arg is None:
            assert cls.default_cause is not None, f"{where}: {cls.__name__} without a cause"
            continue
        literal = _cause_literal(arg)
        if literal is not None:
            assert CAUSES[literal].code == STATUS_OF_ERROR[cls].name, (
                f"{where}: {literal} with {cls.__name__}"
            )
    assert checked > 40
    for cls, code in STATUS_OF_ERROR.items():
        if cls.default_cause is not None:
            assert CAUSES[cls.default_cause].code == code.name, cls


def test_streams_the_broker_ends_name_their_cause_with_its_code() -> None:
    aborts = 0
    for where, call in _calls():
        if _name(call.func) == "abort" and len(call.args) >= 4 and _status_literal(call.args[1]):
            literal = _cause_literal(call.args[3])
            assert literal is not None, f"{where}: abort without a written-out cause"
            assert CAUSES[literal].code == _status_literal(call.args[1]), where
            aborts += 1
        elif _name(call.func) == "Close" and len(call.args) == 3 and isinstance(call.args[0], ast.Constant):
            literal = _cause_literal(call.args[2])
            assert literal is not None and CAUSES[literal].code == call.args[0].value, where
        elif _name(call.func) == "close_all" and len(call.args) == 3:
            literal = _cause_literal(call.args[2])
            assert literal is not None and CAUSES[literal].code == call.args[0].value, where  # type: ignore[attr-defined]
    assert aborts >= 6
    for code, cause in SESSION_END_CAUSES.items():
        assert CAUSES[cause].code == code


def test_no_bare_context_abort_without_details() -> None:
    """Aborts go through broker.status.abort (which adds the ErrorInfo), except the plain
    fallback for a Close that has no cause."""
    bare = [
        where
        for where, call in _calls()
        if isinstance(call.func, ast.Attribute)
        and call.func.attr == "abort"
        and _name(call.func.value) == "context"
    ]
    # status.abort itself, and the Watch fallback for a cause-less Close.
    assert len(bare) == 2, bare


def test_every_error_cause_is_raised_somewhere_in_the_broker() -> None:
    """No dead words: each error cause is written out in broker/ (or is a class default, a
    lease-end cause, which the lease table computes from the lease, or a session end's)."""
    used = {
        literal
        for _, call in _calls()
        for node in ast.walk(call)
        if isinstance(node, ast.Attribute) and (literal := _cause_literal(node)) is not None
    }
    used |= {cls.default_cause for cls in STATUS_OF_ERROR if cls.default_cause is not None}
    used |= set(LEASE_ENDED) | set(SESSION_END_CAUSES.values())
    assert set(Cause) - NOT_ERRORS <= used, set(Cause) - NOT_ERRORS - used


@pytest.mark.parametrize(
    "path", ["docs/clients.md", "docs/broker.md", "proto/kvbroker/v1/broker.proto"], ids=lambda p: p
)
def test_docs_and_proto_name_every_cause(path: str) -> None:
    text = (ROOT / path).read_text()
    missing = [c.value for c in Cause if c.value not in text]
    assert not missing, f"{path} does not mention {missing}"


def test_docs_table_rows_match_the_vocabulary() -> None:
    """docs/clients.md has one table row per cause, with its status code."""
    rows = {}
    for line in (ROOT / "docs/clients.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and cells[0] in {c.value for c in Cause}:
            rows[cells[0]] = cells[1]
    assert set(rows) == {c.value for c in Cause}
    for cause, code in rows.items():
        assert code == (CAUSES[Cause(cause)].code or "-"), cause


def test_errors_refuse_to_go_without_a_cause() -> None:
    with pytest.raises(TypeError):
        errors.FailedPrecondition("no cause given")
    with pytest.raises(ValueError):
        errors.FailedPrecondition("a word outside the vocabulary", "none")
    assert errors.InvalidArgument("x").cause is Cause.BAD_REQUEST
    assert errors.FailedPrecondition("x", "ttl_expired").cause is Cause.TTL_EXPIRED
