"""JobDesc(stream=...) and what a RemoteExecutor's training program reads: a stream's
windows, a dataset's tasks or fed batches, held to the job's stream before any process
of the job is asked to run it (the processes themselves: tests/distributed/test_remote_stream.py)."""

from __future__ import annotations

import numpy as np
import pytest

import fluidps
from fluidps import layers, optimizer
from fluidps.executor.remote.programs import ProgramReads, program_reads
from fluidps.io import StreamLog


def _program(reader: str | None, source: str = "", follow: bool = False):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [2])
        optimizer.SGD(0.1).minimize(layers.mean(layers.fc(x, 1)))
        if reader == "stream":
            layers.stream_reader(source, [x], 4, window_records=8, follow=follow)
        elif reader == "dataset":
            layers.dataset_reader(source, [x], 4)
    return main, startup


@pytest.fixture
def streams(tmp_path):
    """Two logs of records of one field x (float32 [2])."""
    logs = [StreamLog(tmp_path / name) for name in ("a", "b")]
    for log in logs:
        log.append({"x": np.zeros((4, 2), np.float32)})
    return [f"log:{log.path}" for log in logs]


def test_the_job_s_stream_is_kept_in_the_form_every_process_opens(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = fluidps.JobDesc(stream="log:events")
    assert job.stream == f"log:{tmp_path.resolve() / 'events'}"
    assert fluidps.JobDesc(stream=job.stream) == job


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"stream": "kafka://broker/clicks"}, r"stream='kafka://broker/clicks': stream .* expected log:DIR"),
        ({"stream": "log:"}, r"stream='log:': .*expected log:DIR"),
        ({"stream": 3}, r"stream=3: give log:DIR or redis://HOST:PORT/STREAM, as text"),
    ],
)
def test_a_stream_that_names_no_source_is_refused(fields, message):
    with pytest.raises(fluidps.BuilderError, match=message):
        fluidps.JobDesc(**fields)


def test_a_stream_on_kubernetes_is_refused_up_front(streams):
    cluster = fluidps.KubernetesCluster(image="fluidps:0.1", command=("python", "train.py"))
    with pytest.raises(fluidps.BuilderError, match=r"stream= with cluster=: .* reads no stream yet"):
        fluidps.JobDesc(stream=streams[0], cluster=cluster)
    with pytest.raises(fluidps.BuilderError, match="not rendered for Kubernetes yet"):
        fluidps.JobDesc(stream=streams[0], insecure=True).to_kubernetes(image="fluidps:0.1")


def test_a_program_reads_its_stream_with_or_without_the_job_naming_it(streams):
    main, startup = _program("stream", streams[0], follow=True)
    want = ProgramReads(stream=streams[0], follow=True)
    assert program_reads(fluidps.JobDesc(stream=streams[0]), main, startup) == want
    assert program_reads(fluidps.JobDesc(), main, startup) == want
    assert program_reads(fluidps.JobDesc(), *_program(None)) is None  # fed


def test_a_program_that_does_not_read_the_job_s_stream_is_refused(streams, tmp_path):
    job = fluidps.JobDesc(stream=streams[0])
    with pytest.raises(fluidps.BuilderError, match=r"reads stream .*/b: a job's coordinator hands out"):
        program_reads(job, *_program("stream", streams[1]))
    with pytest.raises(fluidps.BuilderError, match=r"reads none \(its batches would be fed\): bind"):
        program_reads(job, *_program(None))
    fluidps.io.Dataset.write(tmp_path / "data", {"x": np.zeros((8, 2), np.float32)}, records_per_shard=4)
    with pytest.raises(fluidps.BuilderError, match=r"reads dataset .*data.*layers.stream_reader"):
        program_reads(job, *_program("dataset", str(tmp_path / "data")))
