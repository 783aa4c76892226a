"""Pipeline stages launched the Fluid way: each stage's own Executor, given its role
(FLUIDPS_STAGE), trains its stage and talks to the others over ZeroMQ; together they train
as the pipeline program does in one process. Here the stages are threads of this process
with an Executor each (tests/distributed/test_pipeline_launch.py runs them as processes)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import fluidps
from fluidps.endpoints import format_endpoint, pick_free_ports
from fluidps.errors import BuilderError, ExecutionError, UnsupportedError
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.settings import RpcSettings
from helpers import shared_weight_mlp, staged_mlp

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH = 12, 8
SECRET = JobSecret.generate()  # (the job's: every stage proves it, as under fluidps launch)


def batches(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(BATCH, 16)).astype("float32"),
            "y": rng.integers(0, 5, (BATCH, 1)).astype("int64"),
        }
        for _ in range(STEPS)
    ]


def executor(**settings) -> fluidps.Executor:
    """A stage's Executor: its runtime speaks with the job's secret, as a launched process's does."""
    rpc = RpcSettings(secret=SECRET, **settings)
    return fluidps.Executor(runtime_config=RuntimeConfig(rpc=rpc))


def adam():
    return fluidps.optimizer.Adam(0.01)


def stage_role(stage: int, endpoints: list[str], trainers: int = 1) -> fluidps.RoleInfo:
    """The role `fluidps launch --stages` gives stage `stage`'s process."""
    env = {
        "TRAINING_ROLE": "TRAINER",
        "PADDLE_TRAINER_ID": "0",
        "PADDLE_TRAINERS_NUM": str(trainers),
        "FLUIDPS_STAGE": str(stage),
        "FLUIDPS_STAGE_ENDPOINTS": ",".join(endpoints),
    }
    return fluidps.role_from_env(env)


def endpoints(count: int) -> list[str]:
    return [format_endpoint("127.0.0.1", p) for p in pick_free_ports("127.0.0.1", count)]


def run_stages(build, feeds, fetch, stages: int = 2, late: float = 0.0, **settings):
    """Each stage in a thread of its own with its own Executor: per stage, (its losses per
    step (the stage that makes `fetch`), its parameters after the last step, its stats).
    The last stage starts `late` seconds after the others."""
    ends = endpoints(stages)
    results: dict[int, tuple[list, dict]] = {}
    errors: list[BaseException] = []

    def stage(k: int) -> None:
        if k == stages - 1:
            time.sleep(late)
        main, startup, loss, _ = build()
        mine = fluidps.transpile_for_role(stage_role(k, ends), main, startup)
        exe = executor(**({"peer_timeout": 30.0} | settings))
        try:
            exe.run(mine.startup)
            owner = mine.plan.owner(fetch(loss))
            got = [exe.run(mine.main, feed=f, fetch_list=[fetch(loss)] if owner == k else []) for f in feeds]
            params = {n: exe.scope[n].copy() for n in mine.plan.stages[k].params}
            results[k] = (got, params, exe.pipeline_stats(mine.main))
        except BaseException as e:  # (reported by the test, not lost in the thread)
            errors.append(e)
        finally:
            exe.close()

    threads = [threading.Thread(target=stage, args=(k,)) for k in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a stage did not finish"
    if errors:
        raise errors[0]
    return results


def run_local(build, feeds, fetch):
    main, startup, loss, _ = build()
    exe = fluidps.Executor()
    exe.run(startup)
    got = [exe.run(main, feed=f, fetch_list=[fetch(loss)]) for f in feeds]
    return got, exe


@pytest.mark.parametrize("schedule_mode", ["1F1B", "F-then-B"])
def test_stages_with_executors_of_their_own_train_as_the_pipeline_in_one_process(schedule_mode):
    def build():
        return staged_mlp({"num_microbatches": 4, "schedule_mode": schedule_mode}, optimizer=adam())

    feeds = batches()
    stages = run_stages(build, feeds, lambda loss: loss.name)
    local, exe = run_local(build, feeds, lambda loss: loss.name)
    losses = stages[1][0]
    assert [float(v) for (v,) in losses] == pytest.approx([float(v) for (v,) in local], rel=1e-6)
    assert stages[0][0] == [[] for _ in feeds]  # (stage 0 was asked for nothing)
    for k in (0, 1):
        assert stages[k][1], f"stage {k} trained no parameters"
        for name, value in stages[k][1].items():
            np.testing.assert_allclose(value, exe.scope[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert [s["stage"] for s in (stages[0][2][0], stages[1][2][0])] == [0, 1]
    assert stages[0][2][0]["steps"] == len(feeds)


def test_a_stage_that_starts_long_after_its_peer_is_waited_for_as_a_peer_warming_up():
    def build():
        return staged_mlp({"num_microbatches": 2})

    feeds = batches()[:3]
    # stage 1 comes 3 peer timeouts late; stage 0, already waiting, gives it the warm-up allowance
    stages = run_stages(
        build, feeds, lambda loss: loss.name, late=3.0, peer_timeout=1.0, heartbeat_interval=0.1
    )
    local, _ = run_local(build, feeds, lambda loss: loss.name)
    assert [float(v) for (v,) in stages[1][0]] == pytest.approx([float(v) for (v,) in local], rel=1e-6)


def test_a_weight_two_launched_stages_read_is_updated_once_with_both_gradients():
    def build():
        return shared_weight_mlp(adam(), {"num_microbatches": 2})

    feeds = batches()
    stages = run_stages(build, feeds, lambda loss: loss.name)
    local, exe = run_local(build, feeds, lambda loss: loss.name)
    assert [float(v) for (v,) in stages[1][0]] == pytest.approx([float(v) for (v,) in local], rel=1e-6)
    updater = 0 if "shared_w" in stages[0][1] else 1
    np.testing.assert_allclose(stages[updater][1]["shared_w"], exe.scope["shared_w"], rtol=1e-6, atol=1e-7)


def test_a_stage_asked_for_a_value_another_stage_makes_says_which_stage_has_it():
    ends = endpoints(2)
    main, startup, loss, _ = staged_mlp({"num_microbatches": 2})
    mine = fluidps.transpile_for_role(stage_role(0, ends), main, startup)
    exe = executor(peer_timeout=5.0)
    try:
        exe.run(mine.startup)
        with pytest.raises(
            ExecutionError, match=rf"stage 0 neither makes nor holds '{loss.name}'.*plan.owner"
        ):
            exe.run(mine.main, feed=batches()[0], fetch_list=[loss])
        with pytest.raises(ExecutionError, match="stage 0 reads x: add it to feed"):
            exe.run(mine.main, feed={"y": batches()[0]["y"]})
    finally:
        exe.close()


def test_a_stage_whose_peer_never_comes_says_so_within_the_peer_timeout():
    ends = endpoints(2)  # (nothing runs stage 0)
    main, startup, _, _ = staged_mlp({"num_microbatches": 2})
    mine = fluidps.transpile_for_role(stage_role(1, ends), main, startup)
    exe = executor(peer_timeout=1.0, heartbeat_interval=0.1, warmup_timeout=2.0)
    try:
        exe.run(mine.startup)
        with pytest.raises(fluidps.Error, match=r"stage 1 waited for .* from stage 0, which never answered"):
            exe.run(mine.main, feed=batches()[0])
        with pytest.raises(ExecutionError, match=r"stage 1 failed at step 1 \(.*\).* start the job again"):
            exe.run(mine.main, feed=batches()[0])  # (half a step ran: no later step can follow it)
    finally:
        exe.close()


def test_what_a_stage_process_is_given_its_stage_and_its_part_of_startup():
    ends = endpoints(2)
    main, startup, _, _ = staged_mlp({"num_microbatches": 2})
    before = main.serialize_to_string(), startup.serialize_to_string()
    mine = [fluidps.transpile_for_role(stage_role(k, ends), main, startup) for k in (0, 1)]
    assert (main.serialize_to_string(), startup.serialize_to_string()) == before  # inputs unchanged
    for k, programs in enumerate(mine):
        assert programs.main.pipeline.this_stage == fluidps.ir.devices.StageEndpoints(k, tuple(ends))
        section = programs.plan.stages[k].program  # its own program: the stage's ops only
        assert programs.main.serialize_to_string() == section.serialize_to_string()
        made = {n for op in programs.startup.global_block().ops for n in op.output_arg_names}
        assert made == set(programs.plan.holds(k)), f"stage {k}'s startup makes what it holds, only"
    assert not set(mine[0].plan.stages[0].params) & {n for op in mine[1].startup.global_block().ops
                                                       for n in op.output_arg_names}  # fmt: skip


def test_bad_stage_roles_are_refused_with_what_to_do():
    main, startup, _, _ = staged_mlp({"num_microbatches": 2})
    with pytest.raises(BuilderError, match=r"has 2 pipeline stages but 3 stage processes .* --stages 2"):
        fluidps.transpile_for_role(stage_role(0, endpoints(3)), main, startup)
    plain, plain_startup, _, _ = staged_mlp(None)
    with pytest.raises(BuilderError, match=r"no pipeline: minimize its loss with .*PipelineOptimizer"):
        fluidps.transpile_for_role(stage_role(0, endpoints(2)), plain, plain_startup)
    with pytest.raises(
        BuilderError, match=r"2 replicas of a pipeline .* through pservers: launch with --pservers"
    ):
        fluidps.transpile_for_role(stage_role(0, endpoints(2), trainers=2), main, startup)
    shared, shared_startup, _, _ = shared_weight_mlp(adam(), {"num_microbatches": 2})
    shared_startup.random_seed = 0
    for op in shared_startup.global_block().ops:
        if op.has_attr("seed"):
            op.set_attr("seed", 0)
    with pytest.raises(
        BuilderError, match="initializes shared_w, which several pipeline stages hold, without a"
    ):
        fluidps.transpile_for_role(stage_role(0, endpoints(2)), shared, shared_startup)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FLUIDPS_STAGE": "2"}, "FLUIDPS_STAGE='2' is invalid: it should hold this process's pipeline stage, an "
         "integer from 0 to 1"),
        ({"FLUIDPS_STAGE_ENDPOINTS": ""}, "FLUIDPS_STAGE_ENDPOINTS is empty"),
        ({"TRAINING_ROLE": "PSERVER", "FLUIDPS_STAGE": "x", "FLUIDPS_STAGE_ENDPOINTS": ""},
         "FLUIDPS_STAGE='x' is invalid: it should hold the pipeline stage whose parameters this pserver serves"),
    ],
)  # fmt: skip
def test_a_bad_stage_environment_is_refused_naming_the_variable(env, message):
    base = {
        "TRAINING_ROLE": "TRAINER",
        "PADDLE_TRAINER_ID": "0",
        "PADDLE_TRAINERS_NUM": "1",
        "FLUIDPS_STAGE": "0",
        "FLUIDPS_STAGE_ENDPOINTS": "127.0.0.1:7001,127.0.0.1:7002",
    }
    with pytest.raises(BuilderError, match=message):
        fluidps.role_from_env(base | env)


PSERVERS = ["127.0.0.1:7101", "127.0.0.1:7102"]


def on_pservers(
    stage: int, replica: int = 0, pserver: int | None = None, mode: str = "sync"
) -> fluidps.RoleInfo:
    """Replica `replica`'s process of stage `stage` (or, with `pserver`, that stage's pserver)
    in a launched job of 2 replicas whose stages keep their parameters on PSERVERS."""
    env = {
        "PADDLE_TRAINERS_NUM": "2",
        "FLUIDPS_STAGE": str(stage),
        "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(PSERVERS),
        "FLUIDPS_MODE": mode,
    }
    if pserver is None:
        env |= {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(replica)}
        env["FLUIDPS_STAGE_ENDPOINTS"] = "127.0.0.1:7001,127.0.0.1:7002"
    else:
        host, port = PSERVERS[pserver].split(":")
        env |= {"TRAINING_ROLE": "PSERVER", "POD_IP": host, "PADDLE_PORT": port}
    return fluidps.role_from_env(env)


def test_a_replicas_stage_sends_its_summed_gradients_to_its_pservers_once_a_step():
    main, startup, _, _ = staged_mlp({"num_microbatches": 2}, optimizer=adam())
    mine = fluidps.transpile_for_role(on_pservers(1, replica=1), main, startup)
    types = [op.type for op in mine.main.global_block().ops]
    assert "adam" not in types and types.count("send_barrier") == 1 and types.count("fetch_barrier") == 1
    plan = fluidps.transpiler.pipeline.stage_plan(mine.main, 1)
    optimize = [op.type for op in plan.optimize.global_block().ops]
    assert (
        "send" in optimize and "recv" in optimize and "fill_constant" not in optimize
    )  # (zeroed at each start)
    sent = [n for op in plan.optimize.global_block().ops if op.type == "send" for n in op.input_arg_names]
    assert sent and all("@GRAD@MERGED" in n for n in sent)
    assert mine.main.pipeline.this_stage.stage == 1 and plan.forward.global_block().ops  # still a stage
    assert {op.type for op in mine.startup.global_block().ops} <= {"recv", "fetch_barrier", "concat"}


def test_a_stages_pserver_updates_that_stages_parameters_only():
    main, startup, _, _ = staged_mlp({"num_microbatches": 2}, optimizer=adam())
    updated = set()
    for j in (0, 1):
        mine = fluidps.transpile_for_role(on_pservers(0, pserver=j), main, startup)
        (serve,) = mine.main.global_block().ops
        assert serve.type == "listen_and_serv" and serve.attr("Fanin") == 2
        updated |= {op.input("Param")[0].split(".block")[0] for b in mine.main.blocks[1:] for op in b.ops
                    if op.type == "adam"}  # fmt: skip
    stage0 = fluidps.PipelineTranspiler().transpile(main).stages[0].params
    assert updated == set(stage0)


def test_replicas_on_pservers_refuse_what_they_cannot_do_yet():
    main, startup, _, _ = staged_mlp({"num_microbatches": 2})
    config = fluidps.DistributeTranspilerConfig(mode="async")
    with pytest.raises(UnsupportedError, match="sync mode only, not 'async'"):
        fluidps.transpile_for_role(on_pservers(0, mode="async"), main, startup, config)
    shared, shared_startup, _, _ = shared_weight_mlp(adam(), {"num_microbatches": 2})
    with pytest.raises(
        UnsupportedError, match="shared_w: a weight several stages read cannot live on pservers"
    ):
        fluidps.transpile_for_role(on_pservers(1), shared, shared_startup)


def test_a_stage_that_trains_nothing_before_others_is_refused_rather_than_left_to_run_ahead():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = fluidps.layers.data("x", [16])
        y = fluidps.layers.data("y", [1], dtype="int64")
        with fluidps.device_guard("stage:0"):
            h = fluidps.layers.scale(x, 2.0)  # no parameter: nothing comes back to stage 0
        with fluidps.device_guard("stage:1"):
            loss = fluidps.layers.mean(fluidps.layers.softmax_with_cross_entropy(fluidps.layers.fc(h, 5), y))
        fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
    with pytest.raises(UnsupportedError, match="stage 0 gets no gradient back from the stages after it"):
        fluidps.transpile_for_role(stage_role(0, endpoints(2)), main, startup)
