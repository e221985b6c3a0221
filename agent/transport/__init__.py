"""How the agent's payloads leave the process: HTTP to the service, a JSONL file, or nowhere.

Every transport has the same small surface (:class:`Transport`): ``send`` one wire payload (a
dict built with :func:`fp8guard.wire.make_batch`), ``close``, and ``stats``. ``send`` is called
from one background thread (see :mod:`fp8guard.agent.shipper`), in order, and never raises:
telemetry must not be able to crash a training run.

:class:`HttpTransport` is the real one. It registers the run, retries transient failures with
the same bytes (the service deduplicates by ``batch_id``), spools to disk while the service is
unreachable and backfills in order once it answers again. Only the standard library, httpx and
:mod:`fp8guard.wire` are imported here.

Modules: ``http`` (HttpTransport: settings, and the two halves joined), ``link`` (opaque bytes
in order, from memory and the spool), ``delivery`` (one POST with retries, a typed ``Answer``),
``breaker``, ``spool`` and ``spool_site`` (the files, and where they live), ``letters`` (the
contract with the payload side, :mod:`fp8guard.agent.drop_reports`), ``flush`` (``fp8guard spool
flush``), ``jsonl``, ``base``, ``payloads`` (read-only counts), ``responses``, ``ratelimit``.
"""

from fp8guard.agent.transport.base import NullTransport, RunInfo, Transport, TransportStats
from fp8guard.agent.transport.http import HttpTransport
from fp8guard.agent.transport.jsonl import JsonlFileTransport

__all__ = [
    "HttpTransport",
    "JsonlFileTransport",
    "NullTransport",
    "RunInfo",
    "Transport",
    "TransportStats",
]
