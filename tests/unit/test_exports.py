"""fluidps.io.Exporter and fluidps.serving.Predictor: versions of a model for serving.

A base holds every variable of the inference program; a delta what changed since its
parent (a table's changed rows only). Base + deltas 1..k load to exactly the values at
export k; a damaged version is refused whole, and a Predictor goes on serving the one
it had.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from serving_model import DIM, ROWS, batch, ctr_model

import fluidps
from fluidps import layers
from fluidps.errors import FeedError, SerializationError
from fluidps.io import Exporter, load_export
from fluidps.io.exports import VERSIONS_DIR, chain, read_manifest, stream_offsets
from fluidps.serving import Predictor


def snapshot(scope, names) -> dict[str, np.ndarray]:
    return {n: np.array(scope.find(n)) for n in names}


def test_base_and_deltas_load_to_each_exports_values(tmp_path):
    main, startup, _test, prob, loss = ctr_model()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = Exporter(tmp_path / "exports", ["ids"], [prob], main, base_every=3)
    states = {}
    for version in range(1, 8):
        exe.run(main, feed=batch(version), fetch_list=[loss], scope=scope)
        assert exporter.export(scope) == version
        states[version] = snapshot(scope, exporter.names)
    kinds = {v: read_manifest(tmp_path / "exports", v)["kind"] for v in (4, 5, 6, 7)}
    assert kinds == {4: "base", 5: "delta", 6: "delta", 7: "base"}
    # The table's delta holds the rows this step touched, not the table.
    delta = read_manifest(tmp_path / "exports", 5)["vars"]
    table = next(n for n in delta if n.startswith("embedding"))
    assert delta[table]["encoding"] == "rows" and delta[table]["bytes"] < ROWS * DIM * 4 / 4
    for version in (4, 5, 6, 7):
        loaded, values = load_export(tmp_path / "exports", version)
        assert loaded == version and set(values) == set(states[version])
        for name, value in states[version].items():
            np.testing.assert_array_equal(values[name], value, err_msg=f"{name} at {version}")
    assert chain(tmp_path / "exports", 6) == [4, 5, 6]
    # Versions before the previous base are released once a new base is written.
    kept = sorted(int(p.name) for p in (tmp_path / "exports" / VERSIONS_DIR).iterdir())
    assert kept == [4, 5, 6, 7]


def test_a_predictor_answers_as_the_executor_and_swaps_versions_whole(tmp_path):
    main, startup, test, prob, loss = ctr_model()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = Exporter(tmp_path / "exports", ["ids"], [prob], main)
    exporter.export(scope)
    predictor = Predictor(tmp_path / "exports")
    query = batch(99)
    want = {1: exe.run(test, feed=query, fetch_list=[prob], scope=scope)[0]}
    assert predictor.version == 1 and predictor.feed_names == ["ids"]
    np.testing.assert_array_equal(predictor.predict({"ids": query["ids"]})[prob.name], want[1])
    for version in (2, 3):
        exe.run(main, feed=batch(version), fetch_list=[loss], scope=scope)
        exporter.export(scope)
        want[version] = exe.run(test, feed=query, fetch_list=[prob], scope=scope)[0]
    assert not np.array_equal(want[1], want[3])

    answers = []
    stop = threading.Event()

    def ask() -> None:  # predictions while versions are swapped in
        while not stop.is_set():
            answers.append(predictor.predict_version({"ids": query["ids"]}))

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        assert predictor.refresh() and predictor.version == 3 and not predictor.refresh()
    finally:
        stop.set()
        asker.join(timeout=60)
    for version, outputs in answers:  # each answer is one version's, whole
        np.testing.assert_array_equal(outputs[prob.name], want[version])
    assert {v for v, _ in answers} <= {1, 3}

    with pytest.raises(FeedError, match="the model takes ids; missing \\['ids'\\], unknown \\['x'\\]"):
        predictor.predict({"x": [[1, 2]]})


def test_a_damaged_version_is_refused_and_the_old_one_goes_on_serving(tmp_path):
    main, startup, _test, prob, loss = ctr_model()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = Exporter(tmp_path / "exports", ["ids"], [prob], main)
    exporter.export(scope)
    predictor = Predictor(tmp_path / "exports")
    before = predictor.predict({"ids": batch(7)["ids"]})[prob.name]
    exe.run(main, feed=batch(1), fetch_list=[loss], scope=scope)
    exporter.export(scope)
    manifest = read_manifest(tmp_path / "exports", 2)
    damaged = tmp_path / "exports" / VERSIONS_DIR / "00000002" / next(iter(manifest["vars"].values()))["file"]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert not predictor.refresh()
    assert predictor.version == 1 and "does not match its checksum" in predictor.last_error
    np.testing.assert_array_equal(predictor.predict({"ids": batch(7)["ids"]})[prob.name], before)
    with pytest.raises(SerializationError, match="does not match its checksum"):
        load_export(tmp_path / "exports")


def test_exports_of_another_program_or_a_broken_manifest_are_refused(tmp_path):
    main, startup, _test, prob, _loss = ctr_model()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    Exporter(tmp_path / "exports", ["ids"], [prob], main).export(scope)
    other_main, other_startup, _, other_prob, _ = ctr_model()
    with fluidps.program_guard(other_main, other_startup):
        doubled = layers.scale(other_prob, 2.0)
    with pytest.raises(SerializationError, match="holds exports of another inference program"):
        Exporter(tmp_path / "exports", ["ids"], [doubled], other_main).export(scope)
    path = tmp_path / "exports" / VERSIONS_DIR / "00000001" / "manifest.json"
    body = json.loads(path.read_text())
    body["kind"] = "delta"  # a delta with no parent
    path.write_text(json.dumps(body))
    with pytest.raises(SerializationError, match="is not a version 1 manifest"):
        load_export(tmp_path / "exports")
    with pytest.raises(SerializationError, match="holds no export yet"):
        load_export(tmp_path / "empty")


def test_a_version_a_dead_writer_never_named_is_replaced_and_a_second_writer_starts_a_base(tmp_path):
    values = {"w": np.zeros((4, 2), np.float32)}
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        out = layers.fc(x, 2, param_attr=fluidps.ParamAttr(name="w"), bias_attr=False)
    first = Exporter(tmp_path / "exports", ["x"], [out], main)
    first.export(values)
    orphan = tmp_path / "exports" / VERSIONS_DIR / "00000002"
    orphan.mkdir()  # renamed into place, never named in LATEST (its writer died)
    values["w"][0, 0] = -0.0  # a change only the bytes show
    assert first.export(values) == 2 and read_manifest(tmp_path / "exports", 2)["kind"] == "delta"
    assert np.signbit(load_export(tmp_path / "exports")[1]["w"][0, 0])
    second = Exporter(tmp_path / "exports", ["x"], [out], main)
    values["w"][1] = 5.0
    assert second.export(values) == 3 and read_manifest(tmp_path / "exports", 3)["kind"] == "base"
    values["w"][2] = 7.0
    assert first.export(values) == 4  # the newest is not first's own: a base, not a delta on 2
    assert read_manifest(tmp_path / "exports", 4)["kind"] == "base"
    np.testing.assert_array_equal(load_export(tmp_path / "exports")[1]["w"], values["w"])


def test_a_predictor_refuses_inputs_that_would_change_on_the_way(tmp_path):
    main, startup, _test, prob, _loss = ctr_model()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    Exporter(tmp_path / "exports", ["ids"], [prob], main).export(scope)
    predictor = Predictor(tmp_path / "exports")
    with pytest.raises(FeedError, match="holds fractions, which would be cut off"):
        predictor.predict({"ids": [[1.5, 2.0]]})
    with pytest.raises(FeedError, match="null, text or ragged rows"):
        predictor.predict({"ids": [[1, None]]})
    assert predictor.predict({"ids": [[1.0, 2.0]]})[prob.name].shape == (1, 2)  # whole numbers are fine


def test_a_version_records_the_stream_offsets_it_was_trained_through(tmp_path):
    """export(offsets=) keeps, by stream, the offset before which every record was trained
    on (bench.streaming's freshness row says a version includes an event by it)."""
    main, startup, _test, prob, loss = ctr_model()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = Exporter(tmp_path / "exports", ["ids"], [prob], main, base_every=2)
    stream = "log:/data/clicks"
    assert exporter.export(scope) == 1 and stream_offsets(tmp_path / "exports", 1) == {}
    for version, committed in ((2, 640), (3, 1280)):  # a delta, then a base: both keep them
        exe.run(main, feed=batch(version), fetch_list=[loss], scope=scope)
        assert exporter.export(scope, offsets={stream: np.int64(committed), "log:/b": 0}) == version
        assert stream_offsets(tmp_path / "exports", version) == {stream: committed, "log:/b": 0}
    assert [read_manifest(tmp_path / "exports", v)["kind"] for v in (2, 3)] == ["delta", "base"]
    assert load_export(tmp_path / "exports")[0] == 3  # (the offsets change nothing else)

    for bad in ({stream: -1}, {stream: 1.5}, {stream: True}, {"": 3}, [(stream, 3)]):
        with pytest.raises(SerializationError, match="must map stream names to offsets >= 0"):
            exporter.export(scope, offsets=bad)
    assert exporter.latest == 3  # nothing written for them
    path = tmp_path / "exports" / VERSIONS_DIR / "00000003" / "manifest.json"
    body = json.loads(path.read_text())
    body["offsets"] = {stream: "1280"}
    path.write_text(json.dumps(body))
    with pytest.raises(SerializationError, match="'offsets' must map stream names to offsets"):
        stream_offsets(tmp_path / "exports", 3)
