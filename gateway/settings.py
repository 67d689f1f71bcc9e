"""Settings of the gateway process (flags > ``AGENTRL_GATEWAY_*`` env > YAML > defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from agentrl.settings import SettingsError
from gateway.engines import ENGINE_KINDS
from gateway.lifecycle.settings import ExportSettings


@dataclass
class ServingSettings:
    """The gateway's own settings (serving, engines, store, limits); :class:`GatewaySettings` adds the
    export ones."""

    engine_url: list[str] = field(default_factory=list, metadata={
        "help": "engine URL(s), comma-separated or repeated (e.g. http://127.0.0.1:30000)"})
    engine_kind: str = field(default="auto", metadata={"choices": ENGINE_KINDS,
        "help": "engine protocol: sglang (SGLang, the embedded engine), vllm (vLLM with VLLM_SERVER_DEV_MODE=1), "
                "auto (detect from the routes each engine answers)"})
    db: str = field(default="sqlite+aiosqlite:///agentrl.db", metadata={
        "help": "SQLAlchemy URL of the conversation store (sqlite+aiosqlite:///path or postgresql+asyncpg://...)"})
    redis: str | None = field(default=None, metadata={
        "help": "Redis URL for state shared between gateway replicas (e.g. redis://127.0.0.1:6379/0)"})
    redis_prefix: str = field(default="agentrl:", metadata={"help": "prefix of every Redis key"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    workers: int = field(default=1, metadata={
        "help": "worker processes serving the port (SO_REUSEPORT); more than 1 needs PostgreSQL and Redis, "
                "which the workers share (see docs/gateway.md, 'Several workers')"})
    admin_key: str = field(default="", metadata={
        "help": "bearer key for /admin/*, POST /v1/sessions and trajectory leasing (required)"})
    runner_key: list[str] = field(default_factory=list, metadata={
        "help": "bearer key(s) for agent runners: create/list sessions and groups, post rewards, finish and "
                "abandon sessions; no engine control, trajectory leasing or trainer version (repeatable)"})
    agent_key: list[str] = field(default_factory=list, metadata={
        "help": "bearer key(s) agents may use without a session: implicit episodes (repeatable)"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer + chat template directory; default: the engine's /get_model_info paths"})
    model_name: str | None = field(default=None, metadata={
        "help": "model id shown by /v1/models; default: the engine's model directory name"})
    public_url: str | None = field(default=None, metadata={
        "help": "URL agents reach the gateway at (for base_url in POST /v1/sessions); default http://host:port"})
    max_body_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "largest request body accepted; larger ones get 413"})
    body_timeout_s: float = field(default=30.0, metadata={
        "help": "a request body not fully received within this many seconds gets 408 (slow or half-sent "
                "requests must not hold connections forever)"})
    header_timeout_s: float = field(default=30.0, metadata={
        "help": "a request whose headers are not complete this many seconds after their first byte (or after "
                "the connection opened) gets 408 and the connection is closed (slowloris); streamed answers "
                "and bodies are not affected (see --body-timeout-s)"})
    max_n: int = field(default=16, metadata={"help": "largest n (choices per request) accepted"})
    drift_check_messages: int = field(default=8, metadata={
        "help": "the template drift check (re-render a child turn's whole history, compare with the stitched "
                "tokens; counted in template_drift_total) runs on every turn whose history has at most this "
                "many messages and on a random share N/messages of longer ones, so that its cost per turn "
                "does not grow with the conversation (0: never; a very large N: always)"})
    unsupported_tools: str = field(default="drop", metadata={
        "help": "Responses tools the gateway cannot serve (web_search, custom, tool_search, ...): drop (from "
                "the prompt, with a warning) or reject (400)"})
    default_max_tokens: int = field(default=0, metadata={
        "help": "max_tokens when a request gives none; 0 = the rest of the context (OpenAI behaviour)"})
    context_length: int = field(default=0, metadata={
        "help": "context length of the model; 0 = ask the engine (/get_server_info)"})
    engine_timeout_s: float = field(default=600.0, metadata={"help": "timeout of one engine request"})
    health_interval_s: float = field(default=5.0, metadata={
        "help": "seconds between engine health checks (a dead engine leaves the rotation until healthy)"})
    pause_timeout_s: float = field(default=600.0, metadata={
        "help": "a pause (POST /admin/pause) with no resume lapses after this and generation resumes at the "
                "current version (a trainer that died mid-push cannot stall every agent)"})
    startup_timeout_s: float = field(default=120.0, metadata={
        "help": "how long start-up waits for at least one healthy engine"})
    log_level: str = field(default="info", metadata={"help": "log level (debug, info, warning)"})


@dataclass
class GatewaySettings(ExportSettings, ServingSettings):
    """Settings of the gateway process: its own (:class:`ServingSettings`) and those of export, leasing and
    staleness, declared once in :class:`~gateway.lifecycle.settings.ExportSettings` (a dataclass collects
    the fields of its last base first: the flags keep their order, the export ones last)."""

    env_prefix: ClassVar[str] = "AGENTRL_GATEWAY_"

    def validate(self) -> None:
        self.engine_url = [u.strip().rstrip("/") for u in self.engine_url if u.strip()]
        if not self.engine_url:
            raise SettingsError(
                "no engine: pass --engine-url http://HOST:PORT (start one with `agentrl engine --port PORT`)")
        if self.engine_kind not in ENGINE_KINDS:
            raise SettingsError(f"--engine-kind {self.engine_kind!r}: use one of {', '.join(ENGINE_KINDS)}")
        for url in self.engine_url:
            if not url.startswith(("http://", "https://")):
                raise SettingsError(f"--engine-url {url!r} must start with http:// or https://")
        if not self.admin_key:
            raise SettingsError("no admin key: pass --admin-key KEY (or set AGENTRL_GATEWAY_ADMIN_KEY)")
        if self.admin_key in self.agent_key:
            raise SettingsError("--agent-key must differ from --admin-key (agents must not get admin rights)")
        if self.admin_key in self.runner_key or set(self.runner_key) & set(self.agent_key):
            raise SettingsError("--runner-key must differ from --admin-key and every --agent-key")
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port {self.port} is not a valid TCP port (1-65535)")
        if self.workers < 1:
            raise SettingsError(f"--workers {self.workers}: must be at least 1")
        if self.workers > 1 and self.db.startswith("sqlite"):
            raise SettingsError(
                f"--workers {self.workers} needs PostgreSQL (--db postgresql+asyncpg://...): SQLite lets one "
                "process write at a time, and each worker has its own group-commit writer, so the workers would "
                "queue on the database file's lock ('database is locked') instead of adding throughput; "
                "use --workers 1 with SQLite")
        if self.workers > 1 and not self.redis:
            raise SettingsError(
                f"--workers {self.workers} needs --redis URL: the workers share the pause state and weight "
                "version, turns in flight, the implicit-session index, the session cache and the lifecycle "
                "leader lock through Redis (without it each worker would keep its own copy)")
        if self.max_body_bytes < 1024:
            raise SettingsError("--max-body-bytes must be at least 1024")
        if not self.pause_timeout_s > 0:
            raise SettingsError("--pause-timeout-s must be > 0 (seconds a pause may last without a resume)")
        if not self.body_timeout_s > 0:
            raise SettingsError("--body-timeout-s must be > 0")
        if not self.header_timeout_s > 0:
            raise SettingsError("--header-timeout-s must be > 0")
        if self.max_n < 1:
            raise SettingsError("--max-n must be at least 1")
        if self.unsupported_tools not in ("drop", "reject"):
            raise SettingsError(f"--unsupported-tools {self.unsupported_tools!r}: use drop or reject")
        if self.default_max_tokens < 0 or self.context_length < 0:
            raise SettingsError("--default-max-tokens and --context-length must be >= 0 (0 = automatic)")
        if not self.db.startswith(("sqlite", "postgresql")):
            raise SettingsError(f"--db {self.db!r}: use sqlite+aiosqlite:///PATH or postgresql+asyncpg://...")
        if self.public_url is None:
            host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
            self.public_url = f"http://{host}:{self.port}"
        self.public_url = self.public_url.rstrip("/")
        ExportSettings.from_settings(self)  # the export fields, checked in one place
