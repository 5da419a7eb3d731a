"""external_env(): which launcher started this process, and the rendezvous it implies.

Pure unit tests: each builds the environment a launcher would set and passes it in
(no processes, no Slurm). The real srun/sbatch path is tested in tests/slurm/.
"""
import subprocess

import pytest

from megaft.launch import env as env_mod
from megaft.launch.env import PORT_BASE, PORT_SPAN, DistEnv, expand_hostlist, external_env, slurm_port


def srun_task(procid, ntasks=2, localid=None, job="4242", step="0", nodelist="node[03-04]", **extra):
    """The variables srun sets in task `procid` of a step with `ntasks` tasks."""
    env = {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid if localid is None else localid),
           "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_JOB_ID": job,
           "SLURM_STEP_ID": step, "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist}
    env.update(extra)
    return env


@pytest.mark.parametrize("hostlist, hosts", [
    ("vm", ["vm"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),  # zero padding, two ranges
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),     # padding kept past a carry
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),                           # top-level commas
    ("x[1,3]y,z[09-10]", ["x1y", "x3y", "z09", "z10"]),                # suffix after a group
    ("r[1-2]-n[0-1]", ["r1-n0", "r1-n1", "r2-n0", "r2-n1"]),           # two groups in one host
    ("node[5]", ["node5"]),
    ("jwb0001.juwels,jwb[0002-0003].juwels", ["jwb0001.juwels", "jwb0002.juwels", "jwb0003.juwels"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[a-b]", "node[3-1]", "n[[1]]", "", "n[1-2x]"])
def test_expand_hostlist_rejects_what_it_cannot_parse(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_unparsable_nodelist_falls_back_to_scontrol(monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="weird1\nweird2\n", stderr="")

    monkeypatch.setattr(env_mod.subprocess, "run", fake_run)
    got = external_env(srun_task(1, nodelist="weird[1-2x]"))
    assert calls == [["scontrol", "show", "hostnames", "weird[1-2x]"]]
    assert got.init_method.startswith("tcp://weird1:")


def test_unparsable_nodelist_without_scontrol_is_a_clear_error(monkeypatch):
    def no_scontrol(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(env_mod.subprocess, "run", no_scontrol)
    with pytest.raises(RuntimeError, match="set MASTER_ADDR"):
        external_env(srun_task(0, nodelist="weird[1-2x]"))
    assert external_env(srun_task(0, nodelist="weird[1-2x]", MASTER_ADDR="h")).init_method.startswith("tcp://h:")


def test_no_launcher_means_local_launch():
    assert external_env({}) is None
    assert external_env({"PATH": "/usr/bin", "MASTER_ADDR": "h"}) is None


def test_torchrun():
    got = external_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert got == DistEnv(rank=3, world_size=4, local_rank=1, init_method="env://")


def test_torchrun_inside_slurm_takes_precedence():
    # torchrun started by srun: Slurm sees 1 task per node, torchrun's ranks are the truth.
    env = srun_task(0, ntasks=2, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1")
    assert external_env(env) == DistEnv(rank=5, world_size=8, local_rank=1, init_method="env://")


def test_slurm_tasks_of_one_step_agree_on_rendezvous():
    ranks = [external_env(srun_task(p, ntasks=4, localid=p % 2, nodelist="node[03-04]")) for p in range(4)]
    assert [(r.rank, r.world_size, r.local_rank) for r in ranks] == [(0, 4, 0), (1, 4, 1), (2, 4, 0), (3, 4, 1)]
    assert {r.init_method for r in ranks} == {f"tcp://node03:{slurm_port('4242', '0')}"}


def test_step_node_list_and_task_count_win_over_the_job():
    # srun -n 2 -w node07 inside a 4-task job on node[05-08]: the step decides.
    env = srun_task(1, ntasks=2, nodelist="node07", SLURM_NTASKS="4", SLURM_JOB_NODELIST="node[05-08]")
    got = external_env(env)
    assert got.world_size == 2 and got.init_method.startswith("tcp://node07:")
    del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_NUM_TASKS"]  # older Slurm: job-level values
    got = external_env(env)
    assert got.world_size == 4 and got.init_method.startswith("tcp://node05:")


@pytest.mark.parametrize("env", [
    srun_task(0, ntasks=1),                                         # srun -n 1
    {k: v for k, v in srun_task(0, ntasks=2).items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS",
                                                                  "SLURM_STEP_NODELIST")},  # sbatch -n 2 batch script
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "vm"},  # salloc shell
], ids=["single-task", "batch-script", "salloc-shell"])
def test_single_slurm_task_is_not_a_one_rank_world(env):
    assert external_env(env) is None  # megaft-train starts launcher.nproc ranks itself


def test_port_is_deterministic_unprivileged_and_differs_between_jobs_and_steps():
    assert slurm_port("123", "0") == slurm_port("123", "0") == PORT_BASE + (123 * 16) % PORT_SPAN
    ports = {slurm_port(str(job), str(step)) for job in range(1000, 1700) for step in range(4)}
    assert len(ports) == 700 * 4  # no two of 700 neighbouring jobs x 4 steps collide
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert PORT_BASE >= 1024 and PORT_BASE + PORT_SPAN <= 32768  # below Linux's ephemeral ports
    assert slurm_port("99999999999", "3") < PORT_BASE + PORT_SPAN
    assert slurm_port("123", "batch") == slurm_port("123", "0")


def test_master_addr_and_port_override_slurm():
    got = external_env(srun_task(1, MASTER_ADDR="10.0.0.9", MASTER_PORT="29511"))
    assert got == DistEnv(rank=1, world_size=2, local_rank=1, init_method="tcp://10.0.0.9:29511")
    got = external_env(srun_task(1, MASTER_PORT="29511"))
    assert got.init_method == "tcp://node03:29511"
    got = external_env(srun_task(1, MASTER_ADDR="head"))
    assert got.init_method == f"tcp://head:{slurm_port('4242', '0')}"


def test_missing_node_list_is_a_clear_error():
    env = {k: v for k, v in srun_task(0).items() if "NODELIST" not in k}
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        external_env(env)


def test_reads_os_environ_by_default(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in srun_task(1, job="77", step="2", nodelist="vm").items():
        monkeypatch.setenv(key, value)
    assert external_env() == DistEnv(1, 2, 1, f"tcp://vm:{PORT_BASE + 77 * 16 + 2}")
