"""A real one-node SLURM cluster on this machine, for tests (docs/running.md, "Running on a SLURM
cluster").

Debian's SLURM 22.05 packages, run without cgroups (the test machines are sandboxes) and with a
cluster-shaped node: 16 CPUs, 128 GB and one fake ``h100`` GPU (``File=/dev/null``), in two
partitions, ``cpu`` (the default) and ``gpu``, as at a typical site. No accounting database:
``sacct`` is disabled, finished jobs stay visible to ``squeue`` and ``scontrol`` for
``MinJobAge`` seconds.

:func:`slurm_unavailable` installs the packages when they are missing (as root, with apt-get) and
otherwise says why the cluster cannot run here; :class:`Cluster` writes the configuration,
starts munged (unless one already answers), slurmctld and slurmd, and stops the daemons it started
by their pids, whatever happened. Jobs' ``srun`` and ``scontrol`` read ``/etc/slurm/slurm.conf``
(``SLURM_CONF`` is not exported into jobs), so the configuration is written there; a file that
was there before is put back at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "munge", "slurm-client")
BINARIES = {  # program -> the package that brings it
    "/usr/sbin/munged": "munge",
    "/usr/bin/munge": "munge",
    "/usr/sbin/slurmctld": "slurmctld",
    "/usr/sbin/slurmd": "slurmd",
    "/usr/bin/sbatch": "slurm-client",
    "/usr/bin/squeue": "slurm-client",
    "/usr/bin/scontrol": "slurm-client",
    "/usr/bin/sinfo": "slurm-client",
}
SLURM_CONF = Path("/etc/slurm/slurm.conf")
GRES_CONF = Path("/etc/slurm/gres.conf")
CONTROLLER_PORT = 6817
NODE_PORT = 6818
MARK = "# written by kvdiverge's tests/slurm_cluster.py"


def missing_programs() -> list[str]:
    """The cluster's programs that are not installed."""
    return [path for path in BINARIES if not os.access(path, os.X_OK)]


def install_packages(log: Path) -> str | None:
    """``apt-get install`` the Debian packages (as root); None when they installed, else why
    not, in one line (the apt output in ``log``)."""
    if os.geteuid() != 0:
        return "not root: cannot install the Debian packages " + " ".join(PACKAGES)
    if shutil.which("apt-get") is None:
        return "no apt-get: cannot install the Debian packages " + " ".join(PACKAGES)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = [
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ]
    with open(log, "a") as out:
        for step in steps:
            try:
                done = subprocess.run(
                    step, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900, check=False
                )
            except subprocess.TimeoutExpired:
                return f"`{' '.join(step)}` ran past 15 minutes (see {log})"
            if done.returncode != 0:
                return f"`{' '.join(step)}` failed with exit {done.returncode} (see {log})"
    return None


def port_in_use(port: int) -> bool:
    """Whether something listens on ``port`` on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def slurm_unavailable(log: Path) -> str | None:
    """None when a cluster can start here, installing the packages first when they are missing;
    else the reason, in one line."""
    if missing_programs():
        reason = install_packages(log)
        if reason is not None:
            return reason
        if missing_programs():
            return (
                "installed "
                + " ".join(PACKAGES)
                + " but still missing "
                + ", ".join(missing_programs())
            )
    if os.geteuid() != 0:
        return "not root: slurmd and slurmctld run as root here (SlurmUser=root)"
    for port in (CONTROLLER_PORT, NODE_PORT):
        if port_in_use(port):
            return f"port {port} is in use: another SLURM cluster runs on this machine"
    return None


def slurm_conf(host: str, scratch: Path, cpus: int, memory_mb: int, gpu_type: str) -> str:
    """The cluster's ``slurm.conf``: no cgroups, no accounting, state and logs in ``scratch``."""
    return f"""{MARK}
ClusterName=kvdiverge-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MinJobAge=600
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
SlurmctldPort={CONTROLLER_PORT}
SlurmdPort={NODE_PORT}
StateSaveLocation={scratch}/state
SlurmdSpoolDir={scratch}/spool
SlurmctldPidFile={scratch}/slurmctld.pid
SlurmdPidFile={scratch}/slurmd.pid
SlurmctldLogFile={scratch}/slurmctld.log
SlurmdLogFile={scratch}/slurmd.log
NodeName={host} CPUs={cpus} RealMemory={memory_mb} Gres=gpu:{gpu_type}:1 State=UNKNOWN
PartitionName=cpu Nodes={host} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes={host} MaxTime=INFINITE State=UP
"""


def gres_conf(host: str, gpu_type: str) -> str:
    """A fake GPU: a character device (a plain file is refused), not auto-detected."""
    return f"{MARK}\nAutoDetect=off\nNodeName={host} Name=gpu Type={gpu_type} File=/dev/null\n"


def _stop(pid: int, name: str, grace: float = 10.0) -> None:
    """SIGTERM ``pid``, then SIGKILL after ``grace`` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)  # our child: reap it
            if done == pid:
                return
        except ChildProcessError:  # not our child: poll for it
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


class Cluster:
    """The one-node cluster, as a context manager: ``with Cluster(scratch) as cluster: ...``.

    ``pids`` maps each daemon this object started to its pid; :meth:`stop` (run on exit,
    whatever happened) stops exactly those, by pid, and puts back ``/etc/slurm`` files it
    replaced."""

    def __init__(
        self, scratch: Path, cpus: int = 16, memory_mb: int = 128000, gpu_type: str = "h100"
    ):
        self.scratch = Path(scratch)
        self.host = socket.gethostname().split(".")[0]
        self.cpus, self.memory_mb, self.gpu_type = cpus, memory_mb, gpu_type
        self.pids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._saved: dict[Path, bytes | None] = {}

    # ---- start and stop ------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _write(self, path: Path, text: str) -> None:
        if path not in self._saved:
            self._saved[path] = path.read_bytes() if path.exists() else None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def start(self, timeout: float = 60.0) -> None:
        """Write the configuration, start the daemons, wait for the node to be idle."""
        for sub in ("state", "spool"):
            (self.scratch / sub).mkdir(parents=True, exist_ok=True)
        self._write(
            SLURM_CONF,
            slurm_conf(self.host, self.scratch, self.cpus, self.memory_mb, self.gpu_type),
        )
        self._write(GRES_CONF, gres_conf(self.host, self.gpu_type))
        self._start_munge(timeout)
        for daemon in ("slurmctld", "slurmd"):
            # -D: in the foreground, so that its pid is the child's; -c (slurmctld): a clean
            # state, no job of an earlier cluster
            extra = ["-c"] if daemon == "slurmctld" else []
            with open(self.scratch / f"{daemon}.out", "w") as log:
                proc = subprocess.Popen(
                    [f"/usr/sbin/{daemon}", "-D", *extra],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.pids[daemon], self._procs[daemon] = proc.pid, proc
            if daemon == "slurmctld":
                self._wait(lambda: self._run(["scontrol", "ping"]).returncode == 0, timeout)
        self._wait(self._node_idle, timeout)

    def _start_munge(self, timeout: float) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return  # a munged already answers: use it, and leave it running
        for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            os.makedirs(folder, exist_ok=True)
            shutil.chown(folder, "munge", "munge")
        with open(self.scratch / "munged.out", "w") as log:
            proc = subprocess.Popen(
                ["/usr/sbin/munged", "--foreground"],
                user="munge",
                group="munge",
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids["munged"], self._procs["munged"] = proc.pid, proc
        self._wait(
            lambda: subprocess.run(["munge", "-n"], capture_output=True).returncode == 0, timeout
        )

    def _wait(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster was not ready in {timeout:.0f} s: {self.logs()}")
            time.sleep(0.5)

    def _node_idle(self) -> bool:
        done = self._run(["sinfo", "-h", "-N", "-o", "%t"])
        return done.returncode == 0 and set(done.stdout.split()) == {"idle"}

    def stop(self) -> None:
        """Stop the daemons this object started, by pid (slurmd, slurmctld, munged), and put
        back the ``/etc/slurm`` files it replaced."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                _stop(pid, name)
            self._procs.pop(name, None)
        for path, content in self._saved.items():
            if content is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(content)
        self._saved.clear()

    # ---- queries -------------------------------------------------------------------------
    def _run(self, command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    def logs(self, tail: int = 2000) -> str:
        """The end of each daemon's log, for a failure message."""
        parts = []
        for name in ("munged.out", "slurmctld.log", "slurmctld.out", "slurmd.log", "slurmd.out"):
            path = self.scratch / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text()[-tail:]}")
        return "\n".join(parts)

    def show_job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o <id>`` as key -> value."""
        done = self._run(["scontrol", "show", "job", "-o", job_id])
        if done.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id}: {done.stderr.strip()}")
        return parse_scontrol(done.stdout)

    def show_job_text(self, job_id: str) -> str:
        """``scontrol show job <id>`` as SLURM prints it (one field group a line)."""
        return self._run(["scontrol", "show", "job", job_id]).stdout

    def queue(self) -> list[dict[str, str]]:
        """Every job ``squeue`` knows (finished ones too, for ``MinJobAge``): its id, name,
        partition, state and comment (Snakemake's ``rule_<name>_wildcards_<values>``)."""
        fields = ["JobId", "JobName", "Partition", "JobState", "Comment"]
        done = self._run(["squeue", "-h", "--states=all", "-o", "%i|%j|%P|%T|%k"])
        if done.returncode != 0:
            raise RuntimeError(f"squeue: {done.stderr.strip()}")
        lines = done.stdout.splitlines()
        return [dict(zip(fields, line.split("|", 4), strict=True)) for line in lines]


def parse_scontrol(text: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` (one line, ``scontrol -o``) as a dict; values hold no
    spaces except a few free-text fields, which end up joined to the previous value."""
    out: dict[str, str] = {}
    key = None
    for token in text.split():
        if "=" in token and token.split("=", 1)[0].replace(":", "").isalnum():
            key, value = token.split("=", 1)
            out[key] = value
        elif key is not None:
            out[key] += " " + token
    return out
