"""The environment contract: role_from_env (a training script's role in a job) and
runtime_config_from_env (how its runtime talks to the others)."""

from __future__ import annotations

import dataclasses

import pytest

import fluidps
from fluidps.errors import BuilderError, CheckpointError, TransportError
from fluidps.executor.env import RoleInfo, role_from_env, rpc_settings_from_env, runtime_config_from_env
from fluidps.executor.ps.checkpointer import CheckpointOverrides
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.security import Security, generate_keys
from fluidps.executor.transport.settings import RpcSettings

EPS = "127.0.0.1:6170,127.0.0.1:6171"


def trainer_env(**over: str) -> dict[str, str]:
    env = {
        "TRAINING_ROLE": "TRAINER",
        "PADDLE_TRAINER_ID": "1",
        "PADDLE_TRAINERS_NUM": "2",
        "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
    }
    return {k: v for k, v in (env | over).items() if v is not None}


def pserver_env(**over: str) -> dict[str, str]:
    env = {
        "TRAINING_ROLE": "PSERVER",
        "PADDLE_TRAINERS_NUM": "2",
        "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
        "POD_IP": "127.0.0.1",
        "PADDLE_PORT": "6171",
    }
    return {k: v for k, v in (env | over).items() if v is not None}


def test_trainer():
    info = role_from_env(trainer_env(FLUIDPS_MODE="async"))
    assert info == RoleInfo("TRAINER", 1, 2, ("127.0.0.1:6170", "127.0.0.1:6171"), None, "async")
    assert info.is_trainer and not info.is_pserver and info.pserver_index is None


def test_pserver():
    info = role_from_env(pserver_env())
    assert info.role == "PSERVER" and info.is_pserver
    assert info.current_endpoint == "127.0.0.1:6171" and info.pserver_index == 1
    assert info.trainer_id == 0 and info.trainers == 2 and info.mode == "sync"


def test_pserver_whose_pod_ip_is_not_in_the_list_has_no_index():
    # Kubernetes lists DNS names while POD_IP is an address: not an error here.
    info = role_from_env(pserver_env(PADDLE_PSERVERS_IP_PORT_LIST="ps-0.job:6171", POD_IP="10.0.0.5"))
    assert info.current_endpoint == "10.0.0.5:6171" and info.pserver_index is None


def test_whitespace_is_tolerated_and_mode_defaults_to_sync():
    env = trainer_env(PADDLE_TRAINER_ID=" 0 ", PADDLE_PSERVERS_IP_PORT_LIST=" a:1 , b:2 ", FLUIDPS_MODE="")
    info = role_from_env(env)
    assert info.trainer_id == 0 and info.pserver_endpoints == ("a:1", "b:2") and info.mode == "sync"


def test_reads_os_environ_by_default(monkeypatch):
    for k, v in trainer_env(FLUIDPS_MODE="ssp").items():
        monkeypatch.setenv(k, v)
    assert role_from_env().mode == "ssp"


def test_ipv6():
    env = pserver_env(PADDLE_PSERVERS_IP_PORT_LIST="[::1]:6170", POD_IP="::1", PADDLE_PORT="6170")
    info = role_from_env(env)
    assert info.current_endpoint == "[::1]:6170" and info.pserver_index == 0


def test_role_info_is_frozen_and_exported():
    info = role_from_env(trainer_env())
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.trainer_id = 3
    assert fluidps.role_from_env is role_from_env and fluidps.RoleInfo is RoleInfo


@pytest.mark.parametrize(
    ("env", "var", "hint"),
    [
        (trainer_env(TRAINING_ROLE=None), "TRAINING_ROLE", "is not set"),
        (trainer_env(TRAINING_ROLE=""), "TRAINING_ROLE", "is empty"),
        (trainer_env(TRAINING_ROLE="WORKER"), "TRAINING_ROLE", "PSERVER or TRAINER"),
        (trainer_env(PADDLE_TRAINERS_NUM=None), "PADDLE_TRAINERS_NUM", "number of trainers"),
        (trainer_env(PADDLE_TRAINERS_NUM="0"), "PADDLE_TRAINERS_NUM", ">= 1"),
        (trainer_env(PADDLE_TRAINERS_NUM="two"), "PADDLE_TRAINERS_NUM", "integer"),
        (trainer_env(PADDLE_TRAINERS_NUM="1_0"), "PADDLE_TRAINERS_NUM", "integer"),
        (trainer_env(PADDLE_TRAINER_ID=None), "PADDLE_TRAINER_ID", "from 0 to 1"),
        (trainer_env(PADDLE_TRAINER_ID="2"), "PADDLE_TRAINER_ID", "from 0 to 1"),
        (trainer_env(PADDLE_TRAINER_ID="-1"), "PADDLE_TRAINER_ID", "rank"),
        (trainer_env(PADDLE_PSERVERS_IP_PORT_LIST=None), "PADDLE_PSERVERS_IP_PORT_LIST", "host:port"),
        # What an endpoint may be is tested in test_endpoints.py; here, that the variable is named.
        (trainer_env(PADDLE_PSERVERS_IP_PORT_LIST="a:1,"), "PADDLE_PSERVERS_IP_PORT_LIST", "bad endpoint ''"),
        (trainer_env(PADDLE_PSERVERS_IP_PORT_LIST="a:1,a:1"), "PADDLE_PSERVERS_IP_PORT_LIST", "twice"),
        (trainer_env(FLUIDPS_MODE="fast"), "FLUIDPS_MODE", "sync, async, ssp"),
        (pserver_env(POD_IP=None), "POD_IP", "host or IP address"),
        (pserver_env(PADDLE_PORT=None), "PADDLE_PORT", "TCP port"),
        (pserver_env(PADDLE_PORT="65536"), "PADDLE_PORT", "1 to 65535"),
        (pserver_env(PADDLE_PORT="http"), "PADDLE_PORT", "1 to 65535"),
        (pserver_env(PADDLE_TRAINER_ID="5"), "PADDLE_TRAINER_ID", "from 0 to 1"),
    ],
)
def test_bad_environment_names_the_variable(env, var, hint):
    with pytest.raises(BuilderError) as e:
        role_from_env(env)
    message = str(e.value)
    assert message.startswith(var) and hint in message, message
    assert isinstance(e.value, fluidps.Error) and isinstance(e.value, RuntimeError)


def test_trainer_ignores_pserver_variables():
    info = role_from_env(trainer_env(POD_IP="", PADDLE_PORT="junk"))
    assert info.current_endpoint is None


# -- the runtime's configuration ------------------------------------------------------------


def test_rpc_settings_from_env(tmp_path):
    assert rpc_settings_from_env({}) == RpcSettings()
    settings = rpc_settings_from_env(
        {"FLUIDPS_PEER_TIMEOUT": "2.5", "FLUIDPS_REQUEST_TIMEOUT": "30", "FLUIDPS_INSECURE": "1"}
    )
    assert (settings.peer_timeout, settings.request_timeout, settings.insecure) == (2.5, 30.0, True)
    assert settings.security is None and not settings.elastic
    assert not rpc_settings_from_env({"FLUIDPS_INSECURE": "0"}).insecure
    assert rpc_settings_from_env({"FLUIDPS_ELASTIC": "1"}).elastic
    assert rpc_settings_from_env({"FLUIDPS_KEYS": ""}).security is None
    keys = generate_keys(tmp_path / "keys")
    assert rpc_settings_from_env({"FLUIDPS_KEYS": str(keys)}).security == Security(keys)
    with pytest.raises(TransportError, match="is not a fluidps key directory"):
        rpc_settings_from_env({"FLUIDPS_KEYS": str(tmp_path)})
    for bad in ("abc", "", "0", "-1", "nan", "inf"):
        with pytest.raises(TransportError, match=f"FLUIDPS_PEER_TIMEOUT='{bad}' is invalid"):
            rpc_settings_from_env({"FLUIDPS_PEER_TIMEOUT": bad})
    waits = rpc_settings_from_env({"FLUIDPS_WARMUP_TIMEOUT": "300", "FLUIDPS_REJOIN_TIMEOUT": "3600"})
    assert (waits.warmup_timeout, waits.rejoin_timeout) == (300.0, 3600.0)
    with pytest.raises(TransportError, match="FLUIDPS_REJOIN_TIMEOUT='0' is invalid"):
        rpc_settings_from_env({"FLUIDPS_REJOIN_TIMEOUT": "0"})


def test_runtime_config_from_env():
    assert runtime_config_from_env({}) == RuntimeConfig()
    config = runtime_config_from_env(
        {
            "FLUIDPS_COORDINATOR": "tcp://127.0.0.1:7000",
            "FLUIDPS_REQUEST_TIMEOUT": "7",
            "FLUIDPS_CHECKPOINT_DIR": "/tmp/ckpt",
            "FLUIDPS_CHECKPOINT_EVERY_STEPS": "5",
            "FLUIDPS_CHECKPOINT_EVERY_SECONDS": "2.5",
            "FLUIDPS_CHECKPOINT_KEEP": "4",
            "FLUIDPS_CHECKPOINT_BASE_EVERY": "3",
            "FLUIDPS_PROFILE": "1",
        }
    )
    assert config.coordinator == "tcp://127.0.0.1:7000" and config.rpc.request_timeout == 7.0
    assert config.checkpoints == CheckpointOverrides("/tmp/ckpt", 5, 2.5, 4, 3)
    assert config.profile and not runtime_config_from_env({"FLUIDPS_PROFILE": "0"}).profile
    assert (
        runtime_config_from_env({"FLUIDPS_CHECKPOINT_EVERY_STEPS": ""}).checkpoints == CheckpointOverrides()
    )
    for name, bad in [
        ("FLUIDPS_CHECKPOINT_EVERY_STEPS", "1.5"),
        ("FLUIDPS_CHECKPOINT_EVERY_STEPS", "-1"),
        ("FLUIDPS_CHECKPOINT_EVERY_SECONDS", "soon"),
        ("FLUIDPS_CHECKPOINT_EVERY_SECONDS", "inf"),
        ("FLUIDPS_CHECKPOINT_KEEP", "0"),
        ("FLUIDPS_CHECKPOINT_BASE_EVERY", "0"),
    ]:
        with pytest.raises(CheckpointError, match=f"{name}='{bad}' is invalid"):
            runtime_config_from_env({name: bad})


def test_incarnations_from_env():
    config = runtime_config_from_env({"FLUIDPS_INCARNATION": "a1", "FLUIDPS_REPLACES": " 7fffffffffffffff "})
    assert (config.incarnation, config.replaces) == (0xA1, (1 << 63) - 1)
    settings = rpc_settings_from_env({"FLUIDPS_TRAINER_INCARNATIONS": "a1,b2,c3"})
    assert settings.trainer_incarnations == (0xA1, 0xB2, 0xC3)
    for name, bad in [
        ("FLUIDPS_INCARNATION", "0"),
        ("FLUIDPS_INCARNATION", "xyz"),
        ("FLUIDPS_REPLACES", "8000000000000000"),  # 2**63
        ("FLUIDPS_TRAINER_INCARNATIONS", "a1,,c3"),
        ("FLUIDPS_TRAINER_INCARNATIONS", "A1"),
    ]:
        with pytest.raises(BuilderError, match=f"{name}='.*' is invalid: it should hold an incarnation"):
            runtime_config_from_env({name: bad})


def test_a_launched_job_s_pservers_know_each_trainer_s_incarnation():
    from fluidps.executor.launch.launcher import job_environments

    jobs = dict(job_environments("127.0.0.1", [6170, 6171], 3, "sync", base={}))
    trainers = [runtime_config_from_env(jobs[f"trainer.{i}"]).incarnation for i in range(3)]
    assert len(set(trainers)) == 3 and all(trainers)
    for pserver in ("pserver.0", "pserver.1"):
        assert rpc_settings_from_env(jobs[pserver]).trainer_incarnations == tuple(trainers)


def test_a_launched_job_shares_one_secret_of_its_own_and_a_secret_comes_from_a_file_or_the_environment(
    tmp_path,
):
    from fluidps.executor.launch.launcher import job_environments

    jobs = dict(job_environments("127.0.0.1", [6170], 2, "sync", base={}))
    (secret,) = {rpc_settings_from_env(env).secret for env in jobs.values()}
    assert secret is not None
    again = dict(job_environments("127.0.0.1", [6170], 2, "sync", base={}))
    assert rpc_settings_from_env(again["trainer.0"]).secret != secret  # each job its own
    assert "hidden" in repr(secret) and secret.hex() not in repr(rpc_settings_from_env(jobs["pserver.0"]))

    path = JobSecret.generate().write(tmp_path / "job.secret")
    from_file = rpc_settings_from_env({"FLUIDPS_JOB_SECRET_FILE": str(path)}).secret
    assert from_file == JobSecret.from_hex(path.read_text(), "test")
    with pytest.raises(TransportError, match="not both"):
        rpc_settings_from_env({"FLUIDPS_JOB_SECRET_FILE": str(path), "FLUIDPS_JOB_SECRET": secret.hex()})
    with pytest.raises(TransportError, match="does not hold a job secret"):
        rpc_settings_from_env({"FLUIDPS_JOB_SECRET": "not hex"})
    path.chmod(0o640)
    with pytest.raises(TransportError, match="may be read by other users"):
        rpc_settings_from_env({"FLUIDPS_JOB_SECRET_FILE": str(path)})
    with pytest.raises(TransportError, match="cannot read the job secret file"):
        rpc_settings_from_env({"FLUIDPS_JOB_SECRET_FILE": str(tmp_path / "missing")})


def test_an_executor_without_a_config_reads_the_environment_when_a_program_needs_its_runtime(monkeypatch):
    monkeypatch.setenv("FLUIDPS_REQUEST_TIMEOUT", "7")
    monkeypatch.setenv("FLUIDPS_COORDINATOR", "tcp://127.0.0.1:7000")
    exe = fluidps.Executor()
    assert not exe.has_runtime  # nothing is read until a program needs it
    assert exe.runtime.settings.request_timeout == 7.0
    assert exe.runtime.readers.coordinator == "tcp://127.0.0.1:7000"
    given = fluidps.Executor(runtime_config=RuntimeConfig())
    assert given.runtime.settings.request_timeout == RpcSettings().request_timeout  # a config given wins
    assert exe.close() == [] and given.close() == []
