"""Chaos: every part of the system killed at random under load while training goes on; a history to check.

Each failure was tested alone and held; what matters in production is the second fault during the
recovery from the first (a Redis restart while a replica is down and a push is paused; the trainer killed
mid-push while the export leader moves). This bench runs all of it at once, on this machine, on 127.0.0.1
only, with parts of its own (the machine's PostgreSQL and Redis are never touched):

* a PostgreSQL cluster (``initdb`` into a temporary directory, ``postgres`` on a free port) and a
  ``redis-server`` on a free port (no persistence: a restart is an empty Redis);
* two embedded engines (the tiny model), two gateway replicas on that PostgreSQL + Redis, the GRPO trainer
  (disk weight pushes to both engines, a checkpoint every step, ``--resume``);
* ``--agents`` agents (episodes at once) in groups of two, each episode a multi-turn conversation through
  the client library (``agentrl/client.py``) and the ``openai`` SDK, rewarded and finished; an agent whose
  replica does not answer retries the same messages on the other one, as a load balancer would;
* a scheduler that kills a part at random with ``kill -9`` (one in four times it pauses it with SIGSTOP
  instead): a gateway replica, Redis, PostgreSQL, an engine, the trainer, or the export leader (the replica
  holding the lifecycle lock). Each comes back after a random 1-15 s (``--down``); faults overlap. A part
  that exits by itself is started again too (what systemd's ``Restart=always`` would do), and recorded.

Bounded two ways. By counts (the test's form): ``--faults K --every-turns M`` injects K faults, each once the
history has grown by M acknowledged turns, and the run stops once every fault has recovered, ``--turns`` turns
are acknowledged, ``--groups`` groups are trained and the trainer has stepped after the last recovery. By
time (``agentrl bench chaos``, 10 minutes): faults every ``--fault-every-s`` on average for ``--seconds``.
``--hang-s`` only guards against a hang.

Then the faults stop, everything is brought back, the agents end their groups, the bench waits out the
idle timeout plus the in-flight marker lifetime, reads every turn and session back from PostgreSQL and what
is left in the queue, and writes all of it to the history (``--out``/history.jsonl; the event kinds are in
``bench/chaos_check.py``), whose invariants it checks last. Exit status 1 on any violation.

    python bench/chaos.py --seed 7 --agents 200 --seconds 600          # agentrl bench chaos (the default)
    python bench/chaos.py --seed 7 --agents 20 --faults 5 --every-turns 30 --turns 200 --groups 8 --down 1,3
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # before bench/, whose gateway.py would shadow the gateway package
sys.path.insert(1, str(REPO / "bench"))

import chaos_check  # noqa: E402

from agentrl.procs import Processes, free_port  # noqa: E402

ADMIN = "chaos-admin-key"
PREFIX = "chaos:"
IDLE_TIMEOUT_S = 5.0
MARKER_TTL_S = 30.0  # gateway.lifecycle.InFlight's ttl_s: a dead replica's in-flight markers lapse after it
TARGETS = ("gateway-0", "gateway-1", "redis", "postgres", "engine-0", "engine-1", "trainer", "leader")


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    path = found[-1] if found else shutil.which(name)
    if path is None:
        raise SystemExit(f"bench/chaos.py needs the PostgreSQL server binaries ({name}): apt-get install postgresql")
    return path


@dataclass
class Part:
    """One process of the system under test, that the scheduler may kill and the keeper starts again."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]  # answers (one quick probe)
    pid: int = 0
    proc: subprocess.Popen[bytes] | None = None
    down_until: float = 0.0  # a fault holds it down (or stopped) until then
    stopped: bool = False  # SIGSTOPped
    starts: int = 0


@dataclass
class Config:
    seed: int
    agents: int
    seconds: float | None
    faults: int
    every_turns: int
    turns: int
    groups: int
    down: tuple[float, float]
    fault_every_s: float
    stop_share: float
    no_kill: tuple[str, ...]
    hang_s: float
    out: Path


class History:
    """The JSON-lines history; ``t`` is seconds since the bench started (monotonic)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "w", encoding="utf-8", buffering=1)
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"k": kind, "t": fields.pop("t", None) or self.now(), **fields}
        self.events.append(event)
        self._fh.write(json.dumps(event, separators=(",", ":")) + "\n")
        return event

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e["k"] == kind)

    def close(self) -> None:
        self._fh.close()


class Chaos:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.work = Path(tempfile.mkdtemp(prefix="agentrl-chaos-"))
        self.procs = Processes(cfg.out / "logs")
        self.history = History(cfg.out / "history.jsonl")
        self.parts: dict[str, Part] = {}
        self.stop_agents = asyncio.Event()
        self.done = asyncio.Event()  # the run is over: faults stop, pollers stop
        self.redis_epoch = 0
        self.trained: set[str] = set()
        self.schedule: list[str] = []
        self.pg_port, self.redis_port = free_port(), free_port()
        self.engine_ports = [free_port(), free_port()]
        self.gateway_ports = [free_port(), free_port()]

    # ------------------------------------------------------------------------------------ the parts
    @property
    def gateways(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    def _postgres(self) -> Part:
        pgdir = self.work / "pg"
        pgdir.mkdir()
        as_user: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root: the postgres OS user owns the cluster
            import pwd

            user = pwd.getpwnam("postgres")
            os.chown(self.work, user.pw_uid, user.pw_gid)
            os.chown(pgdir, user.pw_uid, user.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        data = str(pgdir / "data")
        subprocess.run([*as_user, _pg_bin("initdb"), "-D", data, "-A", "trust", "-U", "postgres", "--no-sync",
                        "-E", "UTF8"], check=True, capture_output=True, timeout=300)
        argv = [*as_user, _pg_bin("postgres"), "-D", data, "-p", str(self.pg_port), "-k", str(pgdir),
                "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"]

        def ready() -> bool:
            return subprocess.run([_pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.pg_port), "-t", "1"],
                                  capture_output=True).returncode == 0
        return Part("postgres", argv, ready)

    def _redis(self) -> Part:
        argv = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.work)]

        def ready() -> bool:
            import redis

            try:
                return bool(redis.Redis(port=self.redis_port, socket_timeout=1).ping())
            except redis.RedisError:
                return False
        return Part("redis", argv, ready)

    @staticmethod
    def _http_ready(url: str) -> Callable[[], bool]:
        def ready() -> bool:
            try:
                return httpx.get(url, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False
        return ready

    def _engine(self, i: int) -> Part:
        port = self.engine_ports[i]
        argv = [sys.executable, "-m", "agentrl", "engine", "--model", "tiny", "--port", str(port),
                "--max-running-requests", "32", "--threads", "1"]
        return Part(f"engine-{i}", argv, self._http_ready(f"http://127.0.0.1:{port}/health"))

    def _gateway(self, i: int) -> Part:
        port = self.gateway_ports[i]
        engines = ",".join(f"http://127.0.0.1:{p}" for p in self.engine_ports)
        argv = [sys.executable, "-m", "agentrl", "gateway", "--engine-url", engines, "--port", str(port),
                "--db", f"postgresql+asyncpg://postgres@127.0.0.1:{self.pg_port}/postgres",
                "--redis", f"redis://127.0.0.1:{self.redis_port}/0", "--redis-prefix", PREFIX,
                "--admin-key", ADMIN, "--log-level", "warning", "--health-interval-s", "1",
                "--group-size", "2", "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--group-timeout-s", "120",
                "--lease-timeout-s", "30", "--tick-s", "0.5", "--startup-timeout-s", "600",
                "--pause-timeout-s", "60", "--stale-max-age-s", "20"]
        return Part(f"gateway-{i}", argv, self._http_ready(f"http://127.0.0.1:{port}/health"))

    def _trainer(self) -> Part:
        argv = [sys.executable, "-m", "agentrl", "train", "--gateway", self.gateways[0], "--admin-key", ADMIN,
                "--model", "tiny", "--device", "cpu", "--group-size", "2", "--batch-groups", "2",
                "--sync-mode", "disk", "--sync-dir", str(self.work / "sync"), "--checkpoint-dir",
                str(self.work / "ckpt"), "--save-every", "1", "--keep-checkpoints", "2", "--resume",
                "--lease-wait-s", "2", "--seed", str(self.cfg.seed)]
        return Part("trainer", argv, lambda: True)  # no health endpoint: its steps are watched instead

    def start(self, part: Part) -> None:
        part.starts += 1
        child = self.procs.start(f"{part.name}-{part.starts}", part.argv,
                                 env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        part.proc, part.pid, part.stopped = child.proc, child.proc.pid, False

    async def until_ready(self, part: Part, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(part.ready):
            if part.proc is not None and part.proc.poll() is not None:
                self.start(part)  # it exited (a dependency was down at its start): start it again
            if time.monotonic() > deadline:
                raise RuntimeError(f"{part.name} not ready after {timeout_s:.0f} s (logs in {self.procs.log_dir})")
            await asyncio.sleep(0.3)

    async def bring_up(self) -> None:
        order = [self._postgres(), self._redis(), self._engine(0), self._engine(1), self._gateway(0),
                 self._gateway(1), self._trainer()]
        for part in order:
            self.parts[part.name] = part
            self.start(part)
            await self.until_ready(part)  # one after another: the second replica finds the schema migrated

    # ------------------------------------------------------------------------------------ faults
    async def _leader(self) -> str:
        """The replica holding the lifecycle leader lock (``host:pid:random``), gateway-0 when none does."""
        import redis.asyncio as aredis

        client = aredis.Redis(port=self.redis_port, socket_timeout=1)
        try:
            holder = await client.get(f"{PREFIX}lifecycle:leader")
        except Exception:  # Redis is down or stopped: nobody can hold the lock now
            holder = None
        finally:
            await client.aclose()
        pid = holder.decode().split(":")[1] if holder else ""
        for name in ("gateway-0", "gateway-1"):
            if str(self.parts[name].pid) == pid:
                return name
        return "gateway-0"

    async def fault(self) -> None:
        """One fault on a part that is up now (the leader only if the replica leading is up)."""
        while True:
            now = time.monotonic()
            choices = [t for t in TARGETS if t == "leader" or self.parts[t].down_until <= now]
            target = self.rng.choice(choices)
            name = await self._leader() if target == "leader" else target
            if self.parts[name].down_until <= now:
                break
            await asyncio.sleep(0.1)  # the leading replica is down already (or everything is): choose again
        mode = "stop" if self.rng.random() < self.cfg.stop_share else "kill"
        if mode == "kill" and name.split("-")[0] in self.cfg.no_kill:
            mode = "stop"  # --no-kill: this kind is only paused (a known, reported violation otherwise)
        down_s = round(self.rng.uniform(*self.cfg.down), 2)
        part = self.parts[name]
        part.down_until = now + down_s
        sig = signal.SIGSTOP if mode == "stop" else signal.SIGKILL
        try:
            os.killpg(part.pid, sig)
        except ProcessLookupError:
            pass  # it had exited by itself: the keeper starts it when the fault is over
        part.stopped = mode == "stop"
        line = f"{target}{'=' + name if target == 'leader' else ''} {mode} {down_s}s"
        self.schedule.append(line)
        self.history.add("fault", target=name, chosen=target, mode=mode, down_s=down_s)
        print(f"[{self.history.now():7.1f}s] fault: {line}", flush=True)
        asyncio.ensure_future(self._recover(part, down_s))

    async def _recover(self, part: Part, down_s: float) -> None:
        await asyncio.sleep(down_s)
        if part.stopped:
            os.killpg(part.pid, signal.SIGCONT)
            part.stopped = False
        else:
            if part.name == "redis":
                self.redis_epoch += 1
            self.start(part)
        part.down_until = 0.0
        self.history.add("recover", target=part.name)

    async def keeper(self) -> None:
        """Start again a part that exited by itself (not under a fault): what a supervisor would do."""
        while not self.done.is_set():
            for part in self.parts.values():
                if part.down_until or part.proc is None or part.proc.poll() is None:
                    continue
                self.history.add("exit", target=part.name, returncode=part.proc.returncode)
                if part.name == "redis":
                    self.redis_epoch += 1
                self.start(part)
            await asyncio.sleep(0.5)

    async def scheduler(self) -> None:
        cfg = self.cfg
        if cfg.seconds is not None:
            end = time.monotonic() + cfg.seconds
            while time.monotonic() < end:
                await asyncio.sleep(min(self.rng.expovariate(1.0 / cfg.fault_every_s), max(0.0, end - time.monotonic())))
                if time.monotonic() < end:
                    await self.fault()
            return
        for _ in range(cfg.faults):
            mark = self.history.count("turn")
            while self.history.count("turn") < mark + cfg.every_turns:
                await asyncio.sleep(0.1)
            await self.fault()

    def all_up(self) -> bool:
        return all(p.down_until == 0.0 for p in self.parts.values())

    # ------------------------------------------------------------------------------------ observers
    async def watch_weights(self) -> None:
        """Each engine's version, polled; an event when it changed, with ``since``: the time of the poll
        before, which still saw the old one (the switch happened between the two)."""
        last: dict[str, Any] = {}
        polled: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=1.0) as http:
            while not self.done.is_set():
                for i, port in enumerate(self.engine_ports):
                    name = f"engine-{i}"
                    asked = self.history.now()
                    try:
                        version = (await http.get(f"http://127.0.0.1:{port}/get_weight_version")).json()["weight_version"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        continue
                    key = (self.parts[name].starts, version)
                    if last.get(name) != key:
                        last[name] = key
                        self.history.add("weights", engine=name, version=int(version), start=key[0],
                                         since=polled.get(name, asked) if key[0] == last.get(f"{name}:start") else asked)
                        last[f"{name}:start"] = key[0]
                    polled[name] = asked
                await asyncio.sleep(0.1)

    async def watch_queue(self) -> None:
        import redis.asyncio as aredis

        seen: set[tuple[int, str]] = set()
        held: set[tuple[int, str]] = set()
        while not self.done.is_set():
            client = aredis.Redis(port=self.redis_port, socket_timeout=1)
            try:
                for entry, fields in await client.xrange(f"{PREFIX}trajq:stream"):
                    key = (self.redis_epoch, entry.decode())
                    if key not in seen:
                        seen.add(key)
                        group = json.loads(fields[b"meta"])["group_id"]
                        self.history.add("export", group=group, entry=key[1], epoch=key[0])
                for raw in (await client.hgetall(f"{PREFIX}trajq:held:meta")).values():
                    group = json.loads(raw)["group_id"]
                    if (self.redis_epoch, group) not in held:  # staleness control holds it (then drops it)
                        held.add((self.redis_epoch, group))
                        self.history.add("held", group=group, epoch=self.redis_epoch)
            except Exception:  # Redis down, stopped or restarting: look again
                pass
            finally:
                await client.aclose()
            await asyncio.sleep(0.2)

    async def watch_trainer(self) -> None:
        path = self.work / "ckpt" / "metrics.jsonl"
        read = 0
        while True:
            if path.exists():
                lines = path.read_text().splitlines()
                for line in lines[read:]:
                    try:
                        m = json.loads(line)
                    except ValueError:
                        break  # a half-written line: read it next time
                    read += 1
                    groups = list(m.get("batch/group_ids") or [])
                    self.trained.update(groups)
                    self.history.add("train", step=m.get("step"), version=m.get("version"), groups=groups,
                                     skipped=m.get("skipped"))
            if self.done.is_set():
                return
            await asyncio.sleep(0.3)

    # ------------------------------------------------------------------------------------ agents
    async def agents(self) -> None:
        from agentrl.client import AsyncGateway, GatewayError, GatewayUnavailable

        def hook(replica: int) -> Callable[[httpx.Response], Any]:
            async def on_response(response: httpx.Response) -> None:
                self.history.add("http", method=response.request.method, path=response.request.url.path,
                                 status=response.status_code, replica=replica,
                                 retry_after=response.headers.get("retry-after"))
            return on_response

        https = [httpx.AsyncClient(timeout=60.0, event_hooks={"response": [hook(i)]},
                                   limits=httpx.Limits(max_connections=1000)) for i in range(2)]
        # a 429 (the staleness budget is full) is waited out 5 s at a time, so that a runner sees the end
        gateways = [AsyncGateway(self.gateways[i], ADMIN, down_wait_s=900.0, admission_wait_s=5.0, http=https[i])
                    for i in range(2)]
        per_group = 2
        runners = max(1, self.cfg.agents // per_group)

        async def runner(n: int) -> None:
            rng = random.Random(self.cfg.seed * 100_003 + n)
            replica = n % 2
            k = 0
            while not self.stop_agents.is_set():
                k += 1
                try:
                    async with gateways[replica].group(f"task-{n}-{k}", size=per_group) as group:
                        await asyncio.gather(*(self.episode(e, rng, https) for e in group))
                except GatewayUnavailable as exc:
                    if exc.status != 429:
                        self.history.add("group_error", runner=n, error=str(exc)[:300])
                except GatewayError as exc:
                    self.history.add("group_error", runner=n, error=str(exc)[:300])
                    await asyncio.sleep(0.5)

        try:
            await asyncio.gather(*(runner(n) for n in range(runners)))
        finally:
            for g in gateways:
                await g.aclose()
            for h in https:
                await h.aclose()

    async def episode(self, episode: Any, rng: random.Random, https: list[httpx.AsyncClient]) -> None:
        """2-4 turns, a reward on the last, finished (by the group's block)."""
        import openai

        async with episode:
            urls = [episode.base_url]
            for a, b in ((0, 1), (1, 0)):
                here = f":{self.gateway_ports[a]}/"
                if here in episode.base_url:
                    urls.append(episode.base_url.replace(here, f":{self.gateway_ports[b]}/"))
            clients = [openai.AsyncOpenAI(base_url=u, api_key=episode.api_key, http_client=https[i % 2],
                                          max_retries=0) for i, u in enumerate(urls)]
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Count to {rng.randint(2, 9)}."}]
            parent = None
            for turn in range(rng.randint(2, 4)):
                reply = await self.turn(clients, episode, messages, parent)
                if reply is None:
                    return  # the session ended under us (recorded): the group's block finishes the rest
                parent = reply.id
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": f"And then {turn}?"}]
            value = float(rng.random() < 0.5)
            await episode.reward(value, response_id=parent)
            self.history.add("reward", session=episode.session_id, response_id=parent, value=value)

    async def turn(self, clients: list[Any], episode: Any, messages: list[dict[str, Any]], parent: str | None
                   ) -> Any:
        """One turn, retried with the same messages while the gateway is down (503, no answer), alternating
        replicas; the acknowledged answer is recorded, or None when the session is no longer active."""
        import openai

        attempt = 0
        t0 = self.history.now()
        while True:
            client = clients[attempt % len(clients)]
            attempt += 1
            try:
                reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
            except (openai.APIConnectionError, openai.APITimeoutError) as exc:
                self.history.add("http", method="POST", path="chat", status=0, error=type(exc).__name__)
                await asyncio.sleep(0.3)
                continue
            except openai.APIStatusError as exc:
                if exc.status_code in (502, 503, 504):
                    await asyncio.sleep(min(1.0, float(exc.response.headers.get("retry-after") or 0.3)))
                    continue
                self.history.add("episode_end", session=episode.session_id, status=exc.status_code,
                                 error=str(exc)[:300])
                return None
            self.history.add("turn", id=reply.id, session=episode.session_id, group=episode.group_id, parent=parent,
                             content=reply.choices[0].message.content, t0=t0)
            return reply

    # ------------------------------------------------------------------------------------ the run
    def finished(self) -> bool:
        cfg = self.cfg
        steps = [e["t"] for e in self.history.events if e["k"] == "train"]
        recovered = [e["t"] for e in self.history.events if e["k"] == "recover"]
        return (self.history.count("fault") >= cfg.faults and self.all_up()
                and self.history.count("turn") >= cfg.turns and len(self.trained) >= cfg.groups
                and (not recovered or (bool(steps) and steps[-1] > recovered[-1])))

    async def run(self) -> int:
        cfg = self.cfg
        self.history.add("start", seed=cfg.seed, config={k: str(v) for k, v in vars(cfg).items()},
                         machine=f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}")
        print(f"chaos: seed {cfg.seed}, {cfg.agents} agents, history {self.history.path}, logs {self.procs.log_dir}",
              flush=True)
        await self.bring_up()
        observers = [asyncio.ensure_future(c) for c in (self.watch_weights(), self.watch_queue(),
                                                        self.watch_trainer(), self.keeper())]
        agents = asyncio.ensure_future(self.agents())
        scheduler = asyncio.ensure_future(self.scheduler())
        deadline = time.monotonic() + cfg.hang_s
        while not (scheduler.done() and (cfg.seconds is not None and self.all_up() or self.finished())):
            if agents.done():
                agents.result()  # raises what ended them
                raise RuntimeError("the agents stopped before the run ended")
            if time.monotonic() > deadline:
                raise RuntimeError(f"hang guard: not done after {cfg.hang_s:.0f} s; "
                                   f"{self.history.count('turn')} turns, {len(self.trained)} groups trained")
            await asyncio.sleep(0.2)
        scheduler.result()
        print(f"[{self.history.now():7.1f}s] faults over; ending the agents' groups", flush=True)
        self.stop_agents.set()
        await asyncio.wait_for(agents, timeout=cfg.hang_s)
        await self.settle()
        # the trainer is paused before the last reads, so that no step acknowledges groups between the read
        # of its metrics and the read of the queue (it would show them as neither trained nor queued)
        trainer = self.parts["trainer"]
        os.killpg(trainer.pid, signal.SIGSTOP)
        trainer.stopped = True
        await asyncio.sleep(0.5)  # a metrics line being written lands
        self.done.set()
        await asyncio.gather(*observers)
        await self.read_back()
        return self.report()

    async def settle(self) -> None:
        """Wait until no rewarded session is active (idle-finished) and no finished one waits for its export
        (the leader's next tick), at most idle timeout + marker lifetime + a few ticks: what the checker then
        allows (a group read back while its finished sessions waited for that tick looked lost)."""
        import asyncpg

        deadline = time.monotonic() + IDLE_TIMEOUT_S + MARKER_TTL_S + 5.0
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{self.pg_port}/postgres")
        try:
            while time.monotonic() < deadline:
                left = await conn.fetchval("SELECT count(*) FROM sessions WHERE status = 'finished' "
                                           "OR (status = 'active' AND reward IS NOT NULL)")
                if left == 0:
                    break
                await asyncio.sleep(0.5)
        finally:
            await conn.close()

    async def read_back(self) -> None:
        import asyncpg
        import redis.asyncio as aredis

        from gateway.store.packing import unpack_i32

        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{self.pg_port}/postgres")
        try:
            read_at = time.time()
            for r in await conn.fetch("SELECT id, session_id, parent_id, response_message, output_versions "
                                      "FROM interactions"):
                message = json.loads(r["response_message"]) if isinstance(r["response_message"], str) \
                    else r["response_message"]
                self.history.add("db_turn", id=r["id"], session=r["session_id"], parent=r["parent_id"],
                                 content=(message or {}).get("content"),
                                 output_versions=unpack_i32(r["output_versions"]))
            for r in await conn.fetch("SELECT id, group_id, status, reward, last_activity_at FROM sessions"):
                self.history.add("db_session", id=r["id"], group=r["group_id"], status=r["status"],
                                 reward=r["reward"], last_activity_at=r["last_activity_at"])
            for r in await conn.fetch("SELECT group_id, status FROM trajectory_queue"):
                self.history.add("queued", group=r["group_id"], reason=f"sql:{r['status']}")
        finally:
            await conn.close()
        client = aredis.Redis(port=self.redis_port, socket_timeout=5)
        try:
            for _, fields in await client.xrange(f"{PREFIX}trajq:stream"):
                self.history.add("queued", group=json.loads(fields[b"meta"])["group_id"], reason="stream")
            for raw in (await client.hgetall(f"{PREFIX}trajq:held:meta")).values():
                self.history.add("queued", group=json.loads(raw)["group_id"], reason="held_stale")
        finally:
            await client.aclose()
        self.history.add("end", t_wall=read_at, idle_timeout_s=IDLE_TIMEOUT_S, marker_ttl_s=MARKER_TTL_S,
                         schedule=self.schedule)

    def report(self) -> int:
        events = self.history.events
        self.history.close()
        summary = chaos_check.summary(events)
        violations = chaos_check.check(events)
        print(json.dumps({"seed": self.cfg.seed, "schedule": self.schedule, **summary}, indent=1))
        for v in violations[:50]:
            print("VIOLATION", v)
        print(f"{len(violations)} violation(s); history {self.history.path}", flush=True)
        return 1 if violations else 0

    def close(self) -> None:
        for part in self.parts.values():
            if part.stopped and part.pid:
                try:
                    os.killpg(part.pid, signal.SIGCONT)  # a stopped process cannot take its SIGTERM
                except ProcessLookupError:
                    pass
        self.procs.__exit__(None, None, None)
        shutil.rmtree(self.work, ignore_errors=True)


def parse(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--agents", type=int, default=200, help="episodes at once (groups of two)")
    p.add_argument("--seconds", type=float, default=None,
                   help="inject faults for this long (the timed form; default 600 unless --faults is given)")
    p.add_argument("--faults", type=int, default=0, help="the counted form: inject this many faults")
    p.add_argument("--every-turns", type=int, default=30, help="counted form: a fault per this many acknowledged turns")
    p.add_argument("--turns", type=int, default=0, help="counted form: stop after this many acknowledged turns")
    p.add_argument("--groups", type=int, default=0, help="counted form: and this many trained groups")
    p.add_argument("--down", default="1,15", help="seconds a killed part stays down: MIN,MAX")
    p.add_argument("--fault-every-s", type=float, default=10.0, help="timed form: mean seconds between faults")
    p.add_argument("--stop-share", type=float, default=0.25, help="share of faults that SIGSTOP instead of kill -9")
    p.add_argument("--no-kill", default="", help="kinds of part only ever paused, never killed (comma-separated: "
                   "redis, postgres, engine, gateway, trainer)")
    p.add_argument("--hang-s", type=float, default=3600.0, help="give up (a hang) after this many seconds")
    p.add_argument("--out", type=Path, default=Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}")
    a = p.parse_args(argv)
    seconds = a.seconds if a.seconds is not None else (None if a.faults else 600.0)
    low, high = (float(x) for x in a.down.split(","))
    return Config(a.seed, a.agents, seconds, a.faults, a.every_turns, a.turns, a.groups, (low, high),
                  a.fault_every_s, a.stop_share, tuple(k for k in a.no_kill.split(",") if k), a.hang_s, a.out)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    chaos = Chaos(cfg)
    try:
        return asyncio.run(chaos.run())
    finally:
        chaos.close()


if __name__ == "__main__":
    raise SystemExit(main())
