"""fluidps.transpile_for_role: one process's programs of a job, through the public API."""

from __future__ import annotations

import pytest
from transpiler_models import EPS2, mlp, ops

import fluidps

ENDPOINTS = EPS2.split(",")


def environment(role: str, mode: str = "sync", **extra: str) -> dict[str, str]:
    """The environment `fluidps launch` gives a process of a 2-trainer, 2-pserver job."""
    env = {"TRAINING_ROLE": role, "PADDLE_TRAINERS_NUM": "2", "PADDLE_PSERVERS_IP_PORT_LIST": EPS2}
    env |= {"FLUIDPS_MODE": mode, **extra}
    return env


def trainer_role(trainer_id: int, mode: str = "sync") -> fluidps.RoleInfo:
    return fluidps.role_from_env(environment("TRAINER", mode, PADDLE_TRAINER_ID=str(trainer_id)))


def pserver_role(endpoint: str, mode: str = "sync") -> fluidps.RoleInfo:
    host, port = endpoint.rsplit(":", 1)
    return fluidps.role_from_env(environment("PSERVER", mode, POD_IP=host, PADDLE_PORT=port))


def serialized(*programs: fluidps.Program) -> list[bytes]:
    return [p.serialize_to_string() for p in programs]


def by_hand(trainer_id: int, mode: str = "sync") -> fluidps.DistributeTranspiler:
    main, startup = mlp()
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(mode=mode))
    t.transpile(trainer_id, main, EPS2, trainers=2, startup_program=startup)
    return t


@pytest.mark.parametrize("trainer_id", [0, 1])
def test_a_trainer_gets_the_trainer_programs_the_transpiler_gives_it(trainer_id):
    main, startup = mlp()
    mine = fluidps.transpile_for_role(trainer_role(trainer_id), main, startup)
    t = by_hand(trainer_id)
    assert serialized(mine.main, mine.startup) == serialized(
        t.get_trainer_program(), t.get_trainer_startup_program()
    )
    assert mine.plan.trainer_id == trainer_id and mine.plan.endpoints == tuple(ENDPOINTS)
    assert "send" in ops(mine.main) and "listen_and_serv" not in ops(mine.main)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_pserver_gets_the_main_and_startup_programs_of_its_endpoint(endpoint):
    main, startup = mlp()
    mine = fluidps.transpile_for_role(pserver_role(endpoint), main, startup)
    assert serialized(mine.main, mine.startup) == serialized(*by_hand(0).get_pserver_programs(endpoint))
    (serve,) = mine.main.global_block().ops
    assert serve.type == "listen_and_serv" and serve.attr("endpoint") == endpoint


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_the_mode_comes_from_the_role_unless_a_config_is_given(mode):
    main, startup = mlp()
    mine = fluidps.transpile_for_role(pserver_role(ENDPOINTS[0], mode), main, startup)
    assert mine.plan.config.mode == mode
    assert serialized(mine.main) == serialized(by_hand(0, mode).get_pserver_program(ENDPOINTS[0]))
    config = fluidps.DistributeTranspilerConfig(mode=mode, min_block_size=1 << 30)  # nothing cut
    sliced = fluidps.transpile_for_role(trainer_role(0, mode), main, startup, config)
    assert sliced.plan.config == config and all(s.name == s.param for s in sliced.plan.slices)


def test_a_config_of_another_mode_than_the_roles_is_refused_naming_both():
    main, startup = mlp()
    config = fluidps.DistributeTranspilerConfig(mode="sync")
    with pytest.raises(fluidps.BuilderError, match="config's mode is 'sync' but the role's is 'async'"):
        fluidps.transpile_for_role(trainer_role(0, "async"), main, startup, config)


def test_a_pserver_whose_endpoint_is_not_the_jobs_is_refused_naming_the_jobs():
    main, startup = mlp()
    stranger = pserver_role("127.0.0.1:7000")
    with pytest.raises(fluidps.BuilderError, match=r"'127\.0\.0\.1:7000' is not a pserver of this job"):
        fluidps.transpile_for_role(stranger, main, startup)


def test_the_inputs_are_unchanged_and_each_process_gets_its_own_copies():
    main, startup = mlp()
    before = serialized(main, startup)
    first = fluidps.transpile_for_role(trainer_role(0), main, startup)
    assert serialized(main, startup) == before
    first.main.global_block().remove_op(0)
    again = fluidps.transpile_for_role(trainer_role(0), main, startup)
    assert serialized(again.main) == serialized(again.plan.trainer_program) != serialized(first.main)
