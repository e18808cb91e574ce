"""``estuary status`` against a real mosquitto holding the retained state of a real run."""

from __future__ import annotations

import itertools
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from estuary.cli import main
from estuary.deploy_cli import report_line
from estuary.status import DeviceView, FederationStatus, format_status
from shared.config import RunConfig
from shared.runtime.process import connect_bus
from shared.transport.local_broker import LocalBroker
from shared.wire.messages import CloudState, DeploymentReport, DeviceHello, Topics, encode
from tests.conftest import tiny_config
from tests.mqtt_probe import clear_retained, close, connect
from tests.test_mqtt_federation import _run_over_mqtt

# its module-scoped fixtures are built once: every test of the module on one pytest worker
pytestmark = pytest.mark.xdist_group("status")

RUN = "status-run"
ROLE_TREES = ("cloud", "edge", "device")


@pytest.fixture(scope="module")
def finished(
    session_broker: LocalBroker,
) -> Iterator[tuple[LocalBroker, RunConfig, str]]:
    """The session's mosquitto after it served a whole 2-round federation (cloud, 2 edges,
    4 devices), and the final model's digest; what the module left retained is cleared
    after it."""
    cfg = tiny_config(
        run={"name": RUN, "rounds": 2}, federation={"num_devices": 4, "num_edges": 2},
        train={"threads": 1},
    )  # fmt: skip
    final, _ = _run_over_mqtt(cfg, session_broker)
    yield session_broker, cfg, final
    clear_retained(session_broker.host, session_broker.port)


def _config_file(tmp_path: Path, cfg: RunConfig) -> str:
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    return str(path)


def _status(
    tmp_path: Path, broker: LocalBroker, cfg: RunConfig, *extra: str
) -> tuple[int, list[str]]:
    argv = ["status", _config_file(tmp_path, cfg), "--broker", f"127.0.0.1:{broker.port}",
            "--wait-s", "1.5", *extra]  # fmt: skip
    return main(argv), argv


def test_status_reads_the_run_from_the_broker(
    finished: tuple[LocalBroker, RunConfig, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broker, cfg, final = finished
    code, _ = _status(tmp_path, broker, cfg, "--json")
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["cloud"]["state"]["phase"] == "done" and doc["cloud"]["state"]["round"] == 2
    # the final model (its blob is the canonical safetensors the digest is of), not the last
    # one the edges were sent
    assert doc["cloud"]["state"]["model_ref"]["sha256"] == final
    assert doc["same_config"] is True and doc["rounds"] == 2
    assert sorted(doc["edges"]) == ["edge0", "edge1"]
    for edge in doc["edges"].values():
        assert edge["online"] is True  # these roles closed without a goodbye: still retained
        assert edge["state"]["round"] == 1  # the last round each edge closed
    assert sorted(doc["devices"]) == ["dev000", "dev001", "dev002", "dev003"]
    homes = {d: v["hello"]["home_edge"] for d, v in doc["devices"].items()}
    assert set(homes.values()) == {"edge0", "edge1"}
    assert doc["rejected"] == {}

    code, _ = _status(tmp_path, broker, cfg)
    text = capsys.readouterr().out
    assert code == 0
    assert f'run "{RUN}" on 127.0.0.1:{broker.port}' in text
    assert "done      round 2 of 2" in text and "running this config" in text
    assert f"global model {final[:12]}" in text
    assert "edges   2 of 2 online" in text and "devices 4 of 4 online" in text
    assert "home edge0" in text and "no deployment report" in text


def test_another_config_and_an_unknown_run_are_named(
    finished: tuple[LocalBroker, RunConfig, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broker, cfg, _ = finished
    other = tiny_config(run={"name": RUN, "rounds": 7}, federation={"num_devices": 4})
    assert _status(tmp_path, broker, other)[0] == 0
    assert "ANOTHER config (digest" in capsys.readouterr().out

    nobody = tiny_config(run={"name": "no-such-run"})
    assert _status(tmp_path, broker, nobody)[0] == 1
    text = capsys.readouterr().out
    assert "no cloud state retained" in text and "dev000   never seen" in text

    assert _status(tmp_path, broker, cfg, "--wait-s", "0")[0] == 2
    assert "--wait-s must be in (0, 600]" in capsys.readouterr().err


def test_bad_retained_messages_are_counted_and_the_rest_shown(
    finished: tuple[LocalBroker, RunConfig, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hello that does not parse, one for dev001 on dev003's topic (wrong sender), and one
    from a device this config does not have, are rejected with their reasons; the other
    devices' state is still reported."""
    broker, cfg, _ = finished
    topics = Topics(RUN)
    client, rc = connect("127.0.0.1", broker.port, None, None)
    assert rc == 0
    bad = DeviceHello(device="dev001", home_edge="edge0", n_samples=1, label_counts=[1] * 10)
    alien = bad.model_copy(update={"device": "dev999"})
    planted = ((topics.device_hello("dev002"), b"{not json"),
               (topics.device_hello("dev003"), encode(bad)),
               (topics.device_hello("dev999"), encode(alien)))  # fmt: skip
    try:
        for topic, payload in planted:
            client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
        assert _status(tmp_path, broker, cfg, "--json")[0] == 0
        doc = json.loads(capsys.readouterr().out)
        assert sum(doc["rejected"].values()) == 3, doc["rejected"]
        assert doc["rejected"]["wrong_sender"] == doc["rejected"]["unknown_instance"] == 1
        assert "dev999" not in doc["devices"]
        assert doc["devices"]["dev002"]["hello"] is None
        assert doc["devices"]["dev003"]["hello"] is None
        assert doc["devices"]["dev000"]["hello"]["device"] == "dev000"
        assert _status(tmp_path, broker, cfg)[0] == 0
        assert "rejected 3 message(s)" in capsys.readouterr().out
    finally:
        for topic, _ in planted:  # clear what it planted (dev002 and dev003 then have no hello)
            client.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)
        close(client)


def test_status_leaves_nothing_on_the_broker(
    finished: tuple[LocalBroker, RunConfig, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It publishes nothing retained (no presence): after a status call, every retained topic
    of the run is still one of the roles' own (cloud, edge, device)."""
    broker, cfg, _ = finished
    assert _status(tmp_path, broker, cfg)[0] == 0
    capsys.readouterr()
    client, rc = connect("127.0.0.1", broker.port, None, None)
    assert rc == 0
    retained: set[str] = set()

    def on_message(_c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        if msg.retain:
            retained.add(msg.topic)

    client.on_message = on_message
    client.subscribe(f"estuary/v1/{RUN}/#", qos=1)
    time.sleep(1.5)
    close(client)
    assert retained, "the run left no retained state"
    prefix = f"estuary/v1/{RUN}/"
    others = [t for t in retained if t.removeprefix(prefix).split("/")[0] not in ROLE_TREES]
    assert not others, others


@pytest.mark.parametrize("will", [True, False], ids=["role", "tool"])
def test_only_a_role_leaves_a_last_will_when_its_connection_drops(
    finished: tuple[LocalBroker, RunConfig, str], will: bool
) -> None:
    """A role's connection that drops without a goodbye leaves its presence offline (its last
    will); ``estuary deploy`` connects as the cloud with ``will=False``, so its dropping does
    not mark the (running) cloud offline."""
    broker, _, _ = finished
    run = f"will-{'role' if will else 'tool'}"
    cfg = tiny_config(run={"name": run}, broker={"port": broker.port})
    bus = connect_bus(cfg, "cloud", "cloud-deploy", None, will=will)
    try:
        sock = bus.client.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)  # the broker sees the TCP stream end, no DISCONNECT
        time.sleep(1.0)
    finally:
        bus.close()
    client, rc = connect("127.0.0.1", broker.port, None, None)
    assert rc == 0
    got: list[bytes] = []
    client.on_message = lambda _c, _u, msg: got.append(bytes(msg.payload)) if msg.retain else None
    client.subscribe(Topics(run).status("cloud"), qos=1)
    time.sleep(1.0)
    close(client)
    if will:
        assert len(got) == 1 and b'"online":false' in got[0].replace(b" ", b""), got
    else:
        assert got == []


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The first line ``proc`` writes to its stdout pipe, waited for at most ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output within {timeout_s} s"
    line = proc.stdout.readline()
    assert line, "the process closed its output"
    return line


def test_watch_follows_a_live_run_until_it_is_done(tmp_path: Path) -> None:
    """``--watch --until-done --json`` started before the run, as its own process: its JSON
    lines follow the cloud from nothing through training to done, and it exits 0 at done."""
    cfg = tiny_config(
        run={"name": "watched", "rounds": 2}, federation={"num_devices": 4, "num_edges": 2},
        train={"threads": 1},
    )  # fmt: skip
    with LocalBroker(kind="mosquitto") as broker:
        argv = [sys.executable, "-m", "estuary.cli", "status", _config_file(tmp_path, cfg),
                "--broker", f"127.0.0.1:{broker.port}", "--wait-s", "0.5", "--watch", "0.2",
                "--until-done", "--for-s", "300", "--json"]  # fmt: skip
        watcher = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            # the watcher is up and has reported the empty broker: its first line
            first = _first_line(watcher, timeout_s=60)
            _run_over_mqtt(cfg, broker)
            out, _ = watcher.communicate(timeout=60)
        finally:
            watcher.kill()
    assert watcher.returncode == 0
    docs = [json.loads(line) for line in [first, *out.splitlines()]]
    assert docs[0]["cloud"]["state"] is None  # nothing retained before the run
    seen = [(d["cloud"]["state"]["phase"], d["cloud"]["state"]["round"])
            for d in docs if d["cloud"]["state"] is not None]  # fmt: skip
    assert ("training", 0) in seen or ("training", 1) in seen, seen
    assert seen[-1] == ("done", 2) and seen.count(("done", 2)) == 1, seen
    for d in docs:  # an open round carries its start and the cloud's deadline (60 x 1.5 + 10)
        state = d["cloud"]["state"]
        if state is not None and state["phase"] == "training":
            assert state["deadline_s"] == 100.0 and abs(state["opened_at"] - d["at"]) < 60
        elif state is not None:
            assert state["opened_at"] is None and state["deadline_s"] is None
    assert all(d["connected"] for d in docs)
    # only changes are printed: no two consecutive lines carry the same state
    states = [json.dumps({k: v for k, v in d.items() if k != "at"}, sort_keys=True) for d in docs]
    assert all(a != b for a, b in itertools.pairwise(states))
    assert len(docs) > 3


def test_watch_prints_changes_only_and_stops_when_told(
    finished: tuple[LocalBroker, RunConfig, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a finished run nothing changes: off a terminal, ``--watch`` prints one report in its
    whole ``--for-s``; ``--until-done`` returns at once, and 3 for a run that never ends."""
    broker, cfg, _ = finished
    start = time.monotonic()
    assert _status(tmp_path, broker, cfg, "--watch", "0.2", "--for-s", "2")[0] == 0
    assert time.monotonic() - start >= 2.0
    text = capsys.readouterr().out
    assert text.count(f'run "{RUN}" on') == 1 and "watching every 0.2 s" in text

    start = time.monotonic()
    assert _status(tmp_path, broker, cfg, "--watch", "--until-done", "--for-s", "60")[0] == 0
    assert time.monotonic() - start < 30.0
    assert "done      round 2 of 2" in capsys.readouterr().out

    nobody = tiny_config(run={"name": "no-such-run"})
    assert (
        _status(tmp_path, broker, nobody, "--watch", "0.2", "--until-done", "--for-s", "1")[0] == 3
    )
    assert "no cloud state retained" in capsys.readouterr().out
    # another config's finished run is not this run being done
    other = tiny_config(run={"name": RUN, "rounds": 7}, federation={"num_devices": 4})
    assert (
        _status(tmp_path, broker, other, "--watch", "0.2", "--until-done", "--for-s", "1")[0] == 3
    )

    for bad, msg in ((("--watch", "0.01"), "--watch must be in [0.2, 600]"),
                     (("--watch", "1", "--for-s", "0"), "--for-s must be in (0, 604800]"),
                     (("--until-done",), "--until-done needs --watch")):  # fmt: skip
        assert _status(tmp_path, broker, cfg, *bad)[0] == 2
        assert msg in capsys.readouterr().err


def test_an_open_round_is_dated_against_its_deadline() -> None:
    cfg = tiny_config(run={"name": RUN, "rounds": 5})
    state = CloudState(round=3, session="a" * 16, phase="training", config_digest=cfg.digest(),
                       opened_at=1_000, deadline_s=100.0)  # fmt: skip
    st = FederationStatus(RUN, cfg.digest(), 5, cloud=state, cloud_online=True)
    # three rounds done, the fourth open
    assert "training  round 4 of 5 (open 42 s of 100 s)   global" in format_status(st, "b", 1042.0)
    assert "(open 150 s of 100 s  OVERDUE)" in format_status(st, "b", 1150.0)
    done = state.model_copy(update={"phase": "done", "opened_at": None, "deadline_s": None})
    text = format_status(FederationStatus(RUN, cfg.digest(), 5, cloud=done), "b", 1150.0)
    assert "done      round 3 of 5   global" in text


def test_classified_and_sampled_reports_show_their_figures() -> None:
    """A device that classified with a deployed classifier (FedDEO's, or its own) shows its
    accuracy and speed, like a sampling one shows its speed, in `estuary status` and in
    `estuary deploy`'s result lines."""
    cfg = tiny_config(run={"name": RUN})
    sha = "ab" * 32
    deployment = "cd" * 32  # the retained deployment the reports are about
    classified = DeploymentReport(
        device="dev000", event="classified", model_sha256=sha, deployment=deployment,
        serving=sha, n=80,
        images_per_s=9261.3, provider="CPUExecutionProvider", request_id="own-test-split",
        accuracy=0.8125,
    )  # fmt: skip
    unlabelled = classified.model_copy(update={"device": "dev001", "accuracy": None,
                                               "request_id": ""})  # fmt: skip
    sampled = DeploymentReport(device="dev002", event="sampled", model_sha256=sha, serving=sha,
                               deployment=deployment, n=16, steps=3, images_per_s=2.5,
                               provider="CPUExecutionProvider")  # fmt: skip
    devices = {r.device: DeviceView(online=True, report=r)
               for r in (classified, unlabelled, sampled)}  # fmt: skip
    st = FederationStatus(RUN, cfg.digest(), 3, devices=devices, deployment=deployment)
    text = format_status(st, "b")
    assert (f"serving {sha[:12]}; classified, accuracy 0.8125 on 80 images (own-test-split) "
            "at 9261.30 images/s (CPUExecutionProvider)") in text  # fmt: skip
    assert "classified, no accuracy (unlabelled) on 80 images at 9261.30 images/s" in text
    assert "sampled 16 in 3 steps at 2.50 images/s (CPUExecutionProvider)" in text
    assert "(loaded)" not in text
    lines = [report_line(r.device, r.model_dump(exclude={"v", "kind"}))
             for r in (classified, sampled)]  # fmt: skip
    assert lines == [
        "  dev000: classified  accuracy 0.8125 on 80 images (own-test-split) at 9261.30 images/s",
        "  dev002:  sampled  2.50 images/s",
    ]


def test_a_run_directory_names_the_running_broker(
    finished: tuple[LocalBroker, RunConfig, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estuary status RUN_DIR` reads the broker's address from ``launch_config.json`` (as
    `estuary demo` writes it: the real port), no --broker needed."""
    broker, cfg, _ = finished
    launched = cfg.model_copy(
        update={"broker": cfg.broker.model_copy(update={"host": "127.0.0.1", "port": broker.port})}
    )
    (tmp_path / "launch_config.json").write_text(launched.to_json())
    assert main(["status", str(tmp_path), "--wait-s", "1.5"]) == 0
    assert f'run "{RUN}" on 127.0.0.1:{broker.port}' in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["status", str(empty)]) == 2
    assert "without launch_config.json or config.json" in capsys.readouterr().err


def test_nothing_listening_is_said_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refused connection is one sentence within seconds, not the MQTT client's connect
    timeout (30 s by default)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        t0 = time.monotonic()
        code = main(["status", _config_file(tmp_path, tiny_config()), "--broker",
                     f"127.0.0.1:{port}"])  # fmt: skip
    assert code == 2 and time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert f"no broker at 127.0.0.1:{port}" in err and "is the run up?" in err
