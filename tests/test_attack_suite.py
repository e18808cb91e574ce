"""The adversarial suite: a small real federation (one cloud, one edge, three devices, two
rounds, seed 0; every role on its own MqttBus in this process, against a real Mosquitto)
attacked by a hostile paho client, on the open broker and on the broker ``estuary
provision`` configures (accounts, ACL, client ids bound to user names).

One undisturbed run gives the final global model's sha256. Every disturbed run must
complete (the cloud finishes and every edge and device leaves on its "done") with that
same model where the attack should change nothing, and the role under attack must have
counted the right rejection reason (``estuary_rejected_messages_total{role,reason}``, read
from the role's traffic counters), exactly. The honest devices are held back in the
attacked round until the attacker is done (:class:`tests.attack_tools.GatedDevice`): the
order in which messages reach a role is the test's, so every count is exact.

Attacks that cannot interact share one disturbed run; each is asserted by its own test.
The module runs in the default test run (about a minute: four federations of ~6 s, the
stalled one waiting out one 8 s round deadline, and the attacks themselves).

Open broker, one run (``bad_input``), attacker speaking as dev001; all end at the
undisturbed model (``test_bad_input_run_ends_at_the_undisturbed_model``):

- malformed JSON, wrong version or kind, missing or mistyped field:
  ``test_malformed_messages_are_counted_by_reason``
- 10,000 bad messages (log flood): ``test_a_flood_is_counted_whole_in_a_few_lines``
- one message over 256 KiB, and 40 x 10 MiB (memory):
  ``test_oversize_messages_never_reach_the_edge``
- pickle, NaN, reshaped blobs: ``test_bad_tensor_blobs_are_refused_unread_and_not_kept``
- a blob that does not hash to its ref: ``test_hash_mismatch_is_refused_and_not_kept``
- a declared blob size the model cannot have:
  ``test_a_blob_too_large_for_the_model_is_not_downloaded``
- an update naming another device: ``test_an_update_in_another_devices_name``
- a replayed (duplicate) update: ``test_a_replayed_update_is_dropped``
- a far-future round; another edge's round: ``test_forged_round_announcements_to_devices``
- 5,000 made-up registrations: ``test_made_up_registrations_are_refused`` (cloud) and
  ``test_made_up_registrations_are_not_the_edges_devices`` (edge)
- nothing else refused, no honest update ``late``: ``test_the_edge_refused_nothing_else``

Open broker, one run (``stall_run``), the attacker owning dev002: an update served from a
foreign source, then one whose own source never answers:
``test_a_stalled_blob_source_holds_up_no_one``, compared with the run in which dev002 is
simply dead (MemoryBus, virtual time), since its update is rightly missing.

Provision's accounts and ACL, one run (``acl_run``), with the credentials of a device the
run does not use: ``test_acl_run_ends_at_the_undisturbed_model`` and

- the edge's client id: ``test_under_acl_a_device_cannot_take_the_edges_connection``
- an update on another device's topic (refused by the broker):
  ``test_under_acl_a_device_cannot_publish_for_another_device``
- a forged retained "done" while the cloud is online (refused by the broker):
  ``test_under_acl_a_device_cannot_end_the_run``

Covered elsewhere, with the same-outcome assertion:

- a finished run's retained "done" and state when the config runs again (same final
  model): ``tests/test_adversarial.py::test_a_rerun_on_a_broker_holding_a_finished_run_``
  ``trains_to_the_same_model``
- a replayed older signed deployment (the device keeps serving the newer one; deployment
  level, MemoryBus: exporting the ONNX models alone takes ~15 s here):
  ``tests/test_deploy_hardening.py::test_a_replayed_older_deployment_is_refused_also_``
  ``after_a_restart``
- a signed deployment whose blob source never answers (the device keeps serving):
  ``tests/test_deploy_hardening.py::test_a_stalled_blob_source_does_not_stop_the_device``
  and ``::test_a_stalled_blob_source_over_mqtt``
- the client-id takeover on both secured broker configs, and the persistent session:
  ``tests/test_client_id_binding.py``

On the open broker anyone may publish as any role, so the forged retained "done" there ends
a run (documented in docs/reliability.md); under the ACL a device account cannot publish
cloud state, which is what is asserted here.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from estuary.provision import provision
from shared.config import RunConfig
from shared.models.init import initial_model
from shared.runtime.service import REJECT_LOG_BURST
from shared.transport.local_broker import LocalBroker, find_mosquitto
from shared.wire.codec import encode_tensors, sha256_hex
from shared.wire.messages import (
    MAX_MESSAGE_BYTES,
    BlobRef,
    CloudState,
    DeviceHello,
    DeviceUpdate,
    EdgeRound,
    Presence,
    Topics,
    encode,
)
from tests.attack_tools import (
    NOT_AUTHORIZED,
    SENTINEL,
    WAIT_S,
    Federation,
    Hostile,
    LogLines,
    Outcome,
    PeakRss,
    flood_from_another_process,
    rejected,
    serve_retained,
    total_rejected,
    wait_for,
    watch_round,
)
from tests.conftest import shared_broker, synthetic_federation, tiny_config

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = [
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
    pytest.mark.xdist_group("attack_suite"),
]

EDGE = "edge0"
DEVICES = ["dev000", "dev001", "dev002"]
HONEST, VICTIM = "dev000", "dev001"  # the open broker's attacker speaks as dev001
FAKE_HELLOS = 5000
FLOOD = 10_000
BIG_MESSAGES, BIG_BYTES = 40, 10 << 20
RSS_BUDGET = 50 << 20
STALL_DEADLINE_S = 8.0

DETONATIONS: list[str] = []


def _detonate(what: str) -> None:
    """Runs only if someone unpickles a payload built with :class:`_Boom`."""
    DETONATIONS.append(what)


class _Boom:
    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return _detonate, ("unpickled",)


def config(name: str, **federation: Any) -> RunConfig:
    """The suite's federation: 1 edge, 3 devices, 2 rounds, seed 0 (run name ``name``)."""
    fed = {"num_devices": 3, "num_edges": 1, "round_deadline_s": 60, **federation}
    return tiny_config(run={"name": name, "rounds": 2}, federation=fed,
                       train={"local_steps": 2, "batch_size": 8, "threads": 1})  # fmt: skip


def model_state(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The run's initial global model: valid tensors to make bad ones from."""
    return dict(initial_model(cfg.model.preset, cfg.model.init, seed=cfg.run.seed).state_dict())


def _first_matrix(state: dict[str, torch.Tensor]) -> str:
    return next(k for k, v in state.items() if v.dim() > 1)


def _with_nan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    k = _first_matrix(state)
    t = state[k].clone()
    t.view(-1)[3] = float("nan")
    return {**state, k: t}


def _reshaped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    k = _first_matrix(state)
    return {**state, k: state[k].reshape(-1)}


def _perturbed(state: dict[str, torch.Tensor], delta: float) -> dict[str, torch.Tensor]:
    k = next(iter(state))
    return {**state, k: state[k] + delta}


def update_of(device: str, session: str, ref: BlobRef | None, fed: Federation,
              round_: int = 0, counts: list[int] | None = None) -> DeviceUpdate:  # fmt: skip
    """A well-formed update of ``device`` (its registered label counts) for ``round_``."""
    if counts is None:
        counts = list(fed.devices[device].label_counts)
    return DeviceUpdate(round=round_, session=session, device=device, edge=EDGE,
                        update_ref=ref, n_samples=sum(counts), label_counts=counts,
                        train_loss=0.5, steps=2, train_seconds=0.1)  # fmt: skip


def ref_of(src: str, data: bytes | None = None, *, size: int | None = None) -> BlobRef:
    """A device-update ref to ``data`` (random bytes nobody holds when None) at ``src``."""
    if data is None:
        data = secrets.token_bytes(64)
    return BlobRef(sha256=sha256_hex(data), size=len(data) if size is None else size,
                   kind="device_update", src=src)  # fmt: skip


@dataclass
class Script:
    """The attacker's steps in one run: a step that times out is recorded, not raised, so
    the run still ends (its gates open) and every test reads what did happen."""

    problems: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # how long each step took

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        except AssertionError as err:
            self.problems.append(f"{what}: {err}")
        finally:
            self.seconds[what] = time.monotonic() - started


#: the open broker (no accounts) this module's open-broker runs share, each under its own
#: run name: the session's
broker = pytest.fixture(scope="module")(shared_broker)


@pytest.fixture(scope="module")
def baseline(broker: LocalBroker) -> Outcome:
    """The undisturbed run: its final model is what every disturbed run must end at."""
    with Federation(config("atk-base"), broker.host, broker.port) as fed:
        outcome = fed.start().wait()
    assert outcome.completed, outcome
    assert [r.updates for r in outcome.rounds] == [3, 3]
    for name, traffic in outcome.traffic.items():
        assert rejected(traffic) == {}, (name, rejected(traffic))
    return outcome


# -- the open broker: every bad-input class from one hostile client ----------------------------


@dataclass
class BadInputRun:
    """What the bad-input run did and saw."""

    outcome: Outcome
    problems: list[str]
    steps: dict[str, float]  # seconds each attack step took
    edge: dict[str, int]  # the edge's rejected counters
    devices: dict[str, dict[str, int]]
    cloud: dict[str, int]
    log: list[str]
    rss_growth: int
    big_received: float  # payload bytes the edge's bus read off the wire during the flood
    kept: dict[str, bool]  # refused blob -> still in the edge's blob store
    asked_for_oversize: bool  # the edge requested the blob declared too large
    cloud_devices: list[str]
    edge_devices_gauge: float | None
    detonations: list[str]


@pytest.fixture(scope="module")
def bad_input(broker: LocalBroker, baseline: Outcome) -> BadInputRun:
    """The federation, attacked in its first round by one hostile client speaking as dev001
    (the open broker lets anyone) with every bad-input class, in this order: made-up
    registrations, malformed messages and a flood of them, an oversize message, 400 MiB of
    oversize messages from another process while the edge is busy, an update in another
    device's name, forged round announcements, bad blobs (pickle, NaN, reshaped, wrong
    hash, declared too big), then, once dev000 reported, a replay of its update. Each step
    waits until the role under attack has counted it; then the devices train."""
    cfg = config("atk-bad")
    topics = Topics(cfg.run.name)
    state = model_state(cfg)
    script, lines = Script(), LogLines()
    DETONATIONS.clear()
    collect = contextlib.contextmanager(lines.install)
    with (
        contextlib.closing(Hostile(broker.host, broker.port, "intruder")) as evil,
        collect(),
        Federation(cfg, broker.host, broker.port, gated_rounds=[0]) as fed,
    ):
        evil.subscribe(topics.edge_round("+"), topics.device_up(HONEST),
                       f"{topics.base}/+/+/want/device/{VICTIM}")  # fmt: skip
        announced = watch_round(evil, topics, EDGE)
        edge, edge_bus = fed.edges[EDGE], fed.bus(EDGE)
        edge_t, cloud_t = fed.traffic(EDGE), fed.traffic("cloud")
        fed.start()
        session = announced(0).session
        up = topics.device_up(VICTIM)
        rss, big_received = PeakRss(), 0.0
        refused: dict[str, str] = {}
        oversize = ref_of(f"device/{VICTIM}", size=4 * len(encode_tensors(state)) + (1 << 20))

        def edge_count(reason: str) -> int:
            return rejected(edge_t).get(f"edge:{reason}", 0)

        with script.step("made-up registrations"):
            hellos = [
                (topics.device_hello(name), encode(DeviceHello(
                    device=name, home_edge=EDGE, n_samples=10, label_counts=[1] * 10)))
                for name in [f"x{i}" for i in range(FAKE_HELLOS - 1000)]
                + [f"dev{i:03d}" for i in range(3, 1003)]
            ]  # fmt: skip
            evil.send_many(hellos)
            wait_for(lambda: rejected(cloud_t).get("cloud:unknown_device", 0) >= FAKE_HELLOS,
                     "the cloud to count every made-up registration")  # fmt: skip

        with script.step("malformed messages and a flood"):
            doc = json.loads(encode(update_of(VICTIM, session, ref_of(f"device/{VICTIM}"), fed)))
            malformed = [
                b'{"v": 1, "kind": "device_update", "round": ',
                json.dumps({**doc, "v": 2}).encode(),
                json.dumps({k: v for k, v in doc.items() if k != "session"}).encode(),
                json.dumps({**doc, "n_samples": "lots"}).encode(),
                encode(DeviceHello(device=VICTIM, home_edge=EDGE, n_samples=1,
                                   label_counts=[1] + [0] * 9)),
            ]  # fmt: skip
            evil.send_many([(up, p) for p in malformed] + [(up, b"{not json")] * FLOOD)
            wait_for(lambda: edge_count("bad_json") >= FLOOD + 1 and edge_count("wrong_kind") >= 1,
                     "the edge to count every malformed message", timeout_s=60)  # fmt: skip

        with script.step("an oversize message"):
            before = total_rejected(edge_t)
            evil.send(up, json.dumps({**doc, "pad": "x" * (MAX_MESSAGE_BYTES + 1)}).encode())
            wait_for(lambda: total_rejected(edge_t) > before, "the oversize message's rejection")

        with script.step("400 MiB of oversize messages at a busy edge"):
            # the edge's thread held by a timer of the test's (as aggregating a large model
            # holds it): what the bus reads off the wire meanwhile waits in its queue
            busy, free = threading.Event(), threading.Event()

            def hold() -> None:
                busy.set()
                free.wait(WAIT_S)

            edge.ep.call_later(0.0, hold)
            wait_for(busy.is_set, "the edge's thread to be busy")
            wire = edge_bus.traffic.transport().get("wire_bytes_received", 0)

            def arrived() -> float:  # the flood's payload bytes the edge's bus has read
                return edge_bus.traffic.transport().get("wire_bytes_received", 0) - wire

            try:
                with rss:
                    flood_from_another_process(broker.host, broker.port, up, BIG_MESSAGES,
                                               BIG_BYTES, up)  # fmt: skip
                    # the sentinel, sent last, has reached the bus (the big ones are whole
                    # multiples of BIG_BYTES)
                    wait_for(lambda: arrived() % BIG_BYTES == len(SENTINEL), "the sentinel")
                    free.set()
                    wait_for(lambda: edge_count("bad_json") >= FLOOD + 2, "the sentinel's count")
            finally:
                free.set()
            big_received = arrived()

        with script.step("an update in another device's name"):
            evil.send(up, encode(update_of(HONEST, session, None, fed)))
            wait_for(lambda: edge_count("wrong_sender") >= 1, "wrong_sender")

        with script.step("forged round announcements"):
            fake = BlobRef(sha256="ab" * 32, size=len(encode_tensors(state)), kind="edge_model",
                           src=f"edge/{EDGE}")  # fmt: skip
            far = EdgeRound(round=10**6, session=session, edge=EDGE, devices=DEVICES,
                            model_ref=fake, deadline_s=60)  # fmt: skip
            other = EdgeRound(round=0, session=session, edge="edge1", devices=DEVICES,
                              model_ref=fake.model_copy(update={"src": "edge/edge1"}),
                              deadline_s=60)  # fmt: skip
            evil.send_many([(topics.edge_round(EDGE), encode(far)),
                            (topics.edge_round("edge1"), encode(other))])  # fmt: skip

        bad_blobs: list[tuple[str, bytes, bytes]] = [  # (name, advertised bytes, served bytes)
            ("pickle", pickle.dumps({"w": torch.zeros(3), "boom": _Boom()}), b""),
            ("nan", encode_tensors(_with_nan(state)), b""),
            ("reshaped", encode_tensors(_reshaped(state)), b""),
            ("hash_mismatch", encode_tensors(_perturbed(state, 7.0)),
             encode_tensors(_perturbed(state, 8.0))),
        ]  # fmt: skip
        chunk_bytes = edge_bus.settings.chunk_bytes
        for name, data, served in bad_blobs:
            with script.step(f"a bad blob ({name})"):
                src = f"device/{VICTIM}"
                ref = ref_of(src, data)
                refused[name] = ref.sha256
                serve_retained(evil, topics, src, ref.sha256, served or data, chunk_bytes)
                before = total_rejected(edge_t)
                evil.send(up, encode(update_of(VICTIM, session, ref, fed)))
                wait_for(lambda: total_rejected(edge_t) > before, f"the {name} blob's rejection")  # noqa: B023

        with script.step("a blob declared larger than the model"):
            before = total_rejected(edge_t)
            evil.send(up, encode(update_of(VICTIM, session, oversize, fed)))
            wait_for(lambda: total_rejected(edge_t) > before, "the oversize blob's rejection")

        fed.release(0, [HONEST])
        with script.step("a replayed update"):
            wait_for(lambda: HONEST in edge.reported, f"{HONEST}'s update to be accepted")
            wait_for(lambda: bool(evil.received(topics.device_up(HONEST))), "a copy of it")
            (_, original), *_ = evil.received(topics.device_up(HONEST))
            evil.send(topics.device_up(HONEST), original)
            wait_for(lambda: edge_count("duplicate") >= 1, "the replay's rejection")
        fed.release(0)
        outcome = fed.wait()
        kept = {name: edge_bus.store.has(sha) for name, sha in refused.items()}
        asked = any(oversize.sha256.encode() in p for _t, p in evil.received("/want/"))
        gauge = edge.metrics.registry.get_sample_value("estuary_connected_devices", {"edge": EDGE})
        result = BadInputRun(
            outcome=outcome, problems=script.problems, steps=script.seconds, edge=rejected(edge_t),
            devices={d: rejected(fed.traffic(d)) for d in DEVICES}, cloud=rejected(cloud_t),
            log=list(lines.lines), rss_growth=rss.growth, big_received=big_received, kept=kept,
            asked_for_oversize=asked, cloud_devices=sorted(fed.cloud.devices),
            edge_devices_gauge=gauge, detonations=list(DETONATIONS),
        )  # fmt: skip
    return result


def test_bad_input_run_ends_at_the_undisturbed_model(bad_input: BadInputRun,
                                                     baseline: Outcome) -> None:  # fmt: skip
    """Every bad-input class in one run: it completes, every round took the three honest
    updates, and the final model is the undisturbed run's."""
    assert bad_input.problems == []
    assert bad_input.outcome.completed, bad_input.outcome.left
    assert [r.updates for r in bad_input.outcome.rounds] == [3, 3]
    assert bad_input.outcome.sha == baseline.sha


def test_malformed_messages_are_counted_by_reason(bad_input: BadInputRun) -> None:
    """Truncated JSON, version 2, a missing session, a mistyped count and a message of the
    wrong kind on dev001's update topic: one rejection each, by reason."""
    edge = bad_input.edge
    for reason in ("bad_version", "missing_field", "bad_field", "wrong_kind"):
        assert edge.get(f"edge:{reason}") == 1, (reason, edge)


def test_a_flood_is_counted_whole_in_a_few_lines(bad_input: BadInputRun) -> None:
    """10,000 copies of a bad message (plus the truncated one and the big flood's sentinel)
    are every one counted, and logged in at most a handful of lines."""
    assert bad_input.edge.get("edge:bad_json") == FLOOD + 2, bad_input.edge
    lines = [ln for ln in bad_input.log if f"{EDGE} rejected input (bad_json)" in ln]
    assert 1 <= len(lines) <= REJECT_LOG_BURST, lines


def test_oversize_messages_never_reach_the_edge(bad_input: BadInputRun) -> None:
    """One message over the 256 KiB limit, and 40 messages of 10 MiB while the edge's thread
    is busy: each dropped by the bus before it is queued (``bus:too_large``) or not even
    sent to it (the broker honours the Maximum Packet Size the bus announces); the edge's
    memory grows by at most 50 MiB (queued, the 40 would take 400 MiB)."""
    assert "edge:too_large" not in bad_input.edge, bad_input.edge  # never queued to the role
    delivered = int(bad_input.big_received // BIG_BYTES)  # the big ones the broker sent on
    assert bad_input.edge.get("bus:too_large") == 1 + delivered, (bad_input.edge, delivered)
    assert bad_input.rss_growth <= RSS_BUDGET, f"{bad_input.rss_growth / 2**20:.0f} MiB"


def test_bad_tensor_blobs_are_refused_unread_and_not_kept(bad_input: BadInputRun) -> None:
    """A pickle, a NaN and a reshaped tensor under their own correct hashes: fetched,
    refused as ``bad_tensors``, never unpickled, and not left in the edge's blob store."""
    assert bad_input.edge.get("edge:bad_tensors") == 3, bad_input.edge
    assert bad_input.detonations == []
    kept = {k: v for k, v in bad_input.kept.items() if k != "hash_mismatch"}
    assert kept == {"pickle": False, "nan": False, "reshaped": False}


def test_hash_mismatch_is_refused_and_not_kept(bad_input: BadInputRun) -> None:
    """Bytes served under another blob's hash: ``blob_hash_mismatch``, nothing stored."""
    assert bad_input.edge.get("edge:blob_hash_mismatch") == 1, bad_input.edge
    assert bad_input.kept["hash_mismatch"] is False


def test_a_blob_too_large_for_the_model_is_not_downloaded(bad_input: BadInputRun) -> None:
    """An update whose blob is declared larger than the model's tensors can encode to (yet
    under the bus's ``max_blob_bytes``): refused as ``blob_too_large`` before the edge asks
    its source for a byte of it."""
    assert bad_input.edge.get("edge:blob_too_large") == 1, bad_input.edge
    assert not bad_input.asked_for_oversize


def test_an_update_in_another_devices_name(bad_input: BadInputRun) -> None:
    """dev001's topic carrying an update that names dev000: ``wrong_sender``."""
    assert bad_input.edge.get("edge:wrong_sender") == 1, bad_input.edge


def test_a_replayed_update_is_dropped(bad_input: BadInputRun) -> None:
    """dev000's update published again after the edge took it: ``duplicate``."""
    assert bad_input.edge.get("edge:duplicate") == 1, bad_input.edge


def test_the_edge_refused_nothing_else(bad_input: BadInputRun) -> None:
    """The edge refused exactly the classes sent (no honest update counted ``late``, no
    other reason standing in for the one expected)."""
    expected = {"bad_json", "bad_version", "missing_field", "bad_field", "wrong_kind",
                "wrong_sender", "bad_tensors", "blob_hash_mismatch", "blob_too_large",
                "duplicate", "unknown_device"}  # fmt: skip
    assert {k.split(":", 1)[1] for k in bad_input.edge if k.startswith("edge:")} == expected


def test_forged_round_announcements_to_devices(bad_input: BadInputRun) -> None:
    """A round far past the run's last, and a round from an edge that is not the device's:
    each device counts one of each and trains neither."""
    for device, counts in bad_input.devices.items():
        assert counts == {"device:round_out_of_range": 1, "device:not_my_edge": 1}, device


def test_made_up_registrations_are_refused(bad_input: BadInputRun) -> None:
    """5,000 registrations under made-up ids and ids past the federation's size, mid-run:
    each counted ``unknown_device`` by the cloud, none stored."""
    assert bad_input.cloud == {"cloud:unknown_device": FAKE_HELLOS}
    assert bad_input.cloud_devices == DEVICES


def test_made_up_registrations_are_not_the_edges_devices(bad_input: BadInputRun) -> None:
    """The edge's connected-devices gauge counts the federation's devices only (the made-up
    ids are refused there too, as ``unknown_device``)."""
    assert bad_input.edge_devices_gauge == len(DEVICES)
    assert bad_input.edge.get("edge:unknown_device") == FAKE_HELLOS


# -- provision's accounts and ACL -------------------------------------------------------------


@dataclass
class AclRun:
    """What the run on the secured broker did and saw."""

    outcome: Outcome
    problems: list[str]
    impersonation: int  # the broker's PUBACK reason code
    forged_done: int
    intruder_disconnects: int
    edge_transport: dict[str, float]
    edge: dict[str, int]
    cloud: dict[str, int]


@pytest.fixture(scope="module")
def acl_run(tmp_path_factory: pytest.TempPathFactory, baseline: Outcome) -> AclRun:
    """The federation on a Mosquitto that enforces ``estuary provision``'s accounts and ACL
    (client ids bound to user names), attacked in its first round with the credentials of
    dev003, a device the broker knows that this run does not use: it connects with the
    edge's client id, publishes an update on dev001's topic, a retained "done" on the cloud's
    state, and on its own topics an update naming dev001 and a registration."""
    cfg = config("atk-acl")
    topics = Topics(cfg.run.name)
    out = tmp_path_factory.mktemp("acl") / "prov"
    provision(config(cfg.run.name, num_devices=4), out)  # accounts dev000 .. dev003
    script = Script()
    with LocalBroker(kind="mosquitto", workdir=out.parent / "broker",
                     password_file=out / "mosquitto" / "passwd",
                     acl_file=out / "mosquitto" / "acl") as secured:  # fmt: skip
        password = (out / "credentials" / "dev003.password").read_text().strip()
        with (
            contextlib.ExitStack() as stack,
            Federation(cfg, secured.host, secured.port, accounts=out, gated_rounds=[0]) as fed,
        ):
            # the edge's client id, dev003's credentials: logged in as dev003
            intruder = Hostile(secured.host, secured.port, f"{cfg.run.name}-{EDGE}",
                               user="dev003", password=password)  # fmt: skip
            stack.callback(intruder.close)
            intruder.subscribe(topics.edge_round(EDGE))
            announced = watch_round(intruder, topics, EDGE)
            edge_t, cloud_t = fed.traffic(EDGE), fed.traffic("cloud")
            fed.start()
            session = announced(0).session
            forged = update_of(VICTIM, session, ref_of(f"device/{VICTIM}"), fed)
            impersonation = intruder.send(topics.device_up(VICTIM), encode(forged))
            done = CloudState(round=0, session=session, phase="done",
                              config_digest=cfg.digest())  # fmt: skip
            forged_done = intruder.send(topics.cloud_state, encode(done), retain=True)
            with script.step("own topic: an update naming dev001"):
                intruder.send(topics.device_up("dev003"), encode(forged))
                wait_for(lambda: total_rejected(edge_t) >= 1, "the edge's rejection")
            with script.step("own topic: a registration"):
                hello = DeviceHello(device="dev003", home_edge=EDGE, n_samples=10,
                                    label_counts=[1] * 10)  # fmt: skip
                intruder.send(topics.device_hello("dev003"), encode(hello))
                wait_for(lambda: total_rejected(cloud_t) >= 1, "the cloud's rejection")
            fed.release(0)
            outcome = fed.wait()
            result = AclRun(
                outcome=outcome, problems=script.problems, impersonation=impersonation,
                forged_done=forged_done, intruder_disconnects=intruder.disconnects,
                edge_transport=fed.bus(EDGE).traffic.transport(), edge=rejected(edge_t),
                cloud=rejected(cloud_t),
            )  # fmt: skip
    return result


def test_acl_run_ends_at_the_undisturbed_model(acl_run: AclRun, baseline: Outcome) -> None:
    """With every role logged in as itself and the attacks above: the run completes both
    rounds with every honest update and ends at the undisturbed model."""
    assert acl_run.problems == []
    assert acl_run.outcome.completed, acl_run.outcome.left
    assert [r.updates for r in acl_run.outcome.rounds] == [3, 3]
    assert acl_run.outcome.sha == baseline.sha


def test_under_acl_a_device_cannot_take_the_edges_connection(acl_run: AclRun) -> None:
    """dev003's credentials with the edge's client id are logged in as dev003: the edge's
    connection is never dropped (no disconnect, no reconnect), nor is the intruder's (no
    tug of war over one client id)."""
    assert acl_run.intruder_disconnects == 0
    assert acl_run.edge_transport.get("disconnects", 0) == 0, acl_run.edge_transport
    assert acl_run.edge_transport.get("reconnects", 0) == 0, acl_run.edge_transport


def test_under_acl_a_device_cannot_publish_for_another_device(acl_run: AclRun) -> None:
    """An update on dev001's topic is refused by the broker (it never reaches the edge); on
    its own topic, one naming dev001 is ``wrong_sender`` and dev003's registration is
    ``unknown_device`` (at the cloud and the edge)."""
    assert acl_run.impersonation == NOT_AUTHORIZED
    assert acl_run.edge == {"edge:wrong_sender": 1, "edge:unknown_device": 1}
    assert acl_run.cloud == {"cloud:unknown_device": 1}


def test_under_acl_a_device_cannot_end_the_run(acl_run: AclRun) -> None:
    """A retained "done" for the running session on the cloud's state topic, from a device
    account while the cloud is online: refused by the broker; the run goes on to its own
    end (both rounds; every edge and device left on the cloud's real "done")."""
    assert acl_run.forged_done == NOT_AUTHORIZED
    assert len(acl_run.outcome.rounds) == 2 and acl_run.outcome.completed


# -- a blob source that never answers -----------------------------------------------------------


@dataclass
class StallRun:
    """What the run with a stalling device did and saw."""

    outcome: Outcome
    problems: list[str]
    edge: dict[str, int]
    honest_in_s: float  # after the stalled update, when both honest updates were taken
    deadline_in_s: float  # after the stalled update, when the round's deadline was due
    expected_sha: str


def _dead_device_sha(cfg: RunConfig, dead: str) -> str:
    """The final model of ``cfg`` when device ``dead`` registers but never trains (MemoryBus,
    virtual time: each round closes at its deadline with the others' updates)."""
    fed, bus, _ = synthetic_federation(cfg)
    fed.devices = [d for d in fed.devices if d.name != dead]
    fed.start()
    ghost = DeviceHello(device=dead, home_edge=EDGE, n_samples=10, label_counts=[1] * 10)
    bus.endpoint("ghost").publish(Topics(cfg.run.name).device_hello(dead), encode(ghost),
                                  kind="x")  # fmt: skip
    assert bus.run(lambda: fed.cloud.done)
    return str(fed.cloud.model_sha)


@pytest.fixture(scope="module")
def stall_run(broker: LocalBroker) -> StallRun:
    """dev002 is the attacker's (no honest agent runs it). In the first round it reports an
    update served by dev000 (a foreign source), then one served by itself that it never
    answers for; only then do the honest devices train. It goes offline once the first round
    is over."""
    cfg = config("atk-stall", round_deadline_s=STALL_DEADLINE_S)
    topics = Topics(cfg.run.name)
    attacker = "dev002"
    counts = [1] * 10
    script = Script()
    hello = DeviceHello(device=attacker, home_edge=EDGE, n_samples=10, label_counts=counts)
    honest_in = deadline_in = float("nan")
    with (
        contextlib.closing(Hostile(broker.host, broker.port, "staller")) as evil,
        Federation(cfg, broker.host, broker.port, absent=[attacker], gated_rounds=[0]) as fed,
    ):
        evil.send(topics.device_hello(attacker), encode(hello), retain=True)
        evil.subscribe(topics.edge_round(EDGE), f"{topics.base}/+/+/want/device/{attacker}")
        announced = watch_round(evil, topics, EDGE)
        edge, edge_t = fed.edges[EDGE], fed.traffic(EDGE)
        fed.start()
        session = announced(0).session
        size = len(encode_tensors(model_state(cfg)))
        with script.step("an update served by another device"):
            foreign = update_of(attacker, session, ref_of("device/dev000", size=size), fed,
                                counts=counts)  # fmt: skip
            evil.send(topics.device_up(attacker), encode(foreign))
            wait_for(lambda: total_rejected(edge_t) >= 1, "the foreign source's rejection")
        with script.step("an update whose source never answers"):
            silent = ref_of(f"device/{attacker}", size=size)
            evil.send(topics.device_up(attacker),
                      encode(update_of(attacker, session, silent, fed, counts=counts)))  # fmt: skip
            sent = time.monotonic()
            wait_for(lambda: bool(evil.received(f"/want/device/{attacker}")),
                     "the edge to ask for the silent blob")  # fmt: skip
            deadline_in = edge.deadline_at - sent
        fed.release(0)
        with script.step("the honest updates"):
            wait_for(lambda: {"dev000", "dev001"} <= set(edge.reported), "the honest updates",
                     timeout_s=STALL_DEADLINE_S * 3)  # fmt: skip
            honest_in = time.monotonic() - sent
        with script.step("offline after the first round"):
            announced(1)
            gone = Presence(name=attacker, role="device", online=False)
            evil.send(topics.status(f"device/{attacker}"), encode(gone), retain=True)
        outcome = fed.wait()
        with script.step("the stalled fetch counted"):
            wait_for(lambda: rejected(edge_t).get("edge:timeout", 0) >= 1, "edge:timeout")
        result = StallRun(outcome=outcome, problems=script.problems, edge=rejected(edge_t),
                          honest_in_s=honest_in, deadline_in_s=deadline_in,
                          expected_sha=_dead_device_sha(cfg, attacker))  # fmt: skip
    return result


def test_a_stalled_blob_source_holds_up_no_one(stall_run: StallRun) -> None:
    """An update served from another device's subtree is refused (``foreign_source``); one
    whose own source never answers holds up no one: the honest updates are taken while its
    download waits, none is counted ``late``, and it is dropped at the round's deadline
    (``timeout``). The run ends at the model of a run in which dev002 is simply dead."""
    assert stall_run.problems == []
    assert stall_run.edge == {"edge:foreign_source": 1, "edge:timeout": 1}, stall_run.edge
    assert stall_run.honest_in_s < stall_run.deadline_in_s - 1.0, (
        stall_run.honest_in_s, stall_run.deadline_in_s)  # fmt: skip
    assert stall_run.outcome.completed, stall_run.outcome.left
    assert [r.updates for r in stall_run.outcome.rounds] == [2, 2]
    assert stall_run.outcome.sha == stall_run.expected_sha
