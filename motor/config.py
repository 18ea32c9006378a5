"""RunnerConfig: every option of `motor serve`, its default, and its validation.

Options come from three places, weakest first: the embedded defaults below, a TOML file
(`--config FILE`, unknown keys refused so a typo fails loudly), and command-line flags.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Literal

import msgspec

from .smallfiles import read_named
from .wire import CHANGE_ANSWER_S, CHANGE_TIMEOUT_S, default_socket_str, default_state_dir_str

GiB = 1024**3
#: the longest path a Unix socket can be bound at (sun_path holds 108 bytes with its NUL)
MAX_SOCKET_PATH = 107
SEED_FLOOR_BYTES = 128 * GiB  # scheduling.md: "default 128 GiB (137438953472 bytes)"

Isolation = Literal["auto", "systemd", "cgroup", "affinity", "none"]
LogLevel = Literal["debug", "info", "warning", "error"]


class ConfigError(ValueError):
    """A bad option value: `serve` prints it on one line and exits 2."""


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """`128G`, `64GiB`, `512MB`, `4096` -> bytes (binary multiples: K = 1024)."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        return text
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"not a size: {text!r} (use bytes or a suffix such as 128G or 64GiB)")
    number, unit, _ = m.groups()
    return int(number) * 1024 ** _UNITS[unit.lower()]


def default_state_dir() -> Path:
    return Path(default_state_dir_str())


def default_socket() -> Path:
    return Path(default_socket_str())


#: Seconds a new (or kept-alive) connection may take to send a complete request head, by
#: default (`--head-timeout`; motor/api/server.py)
HEAD_TIMEOUT_S = 5.0
#: the shortest --head-timeout: clients reuse an idle kept-alive connection within 1 s
#: (motor/client.py, `_Wire.REUSE_S`), so the runner must keep one longer than that
HEAD_TIMEOUT_MIN_S = 2.0
#: RunnerConfig.output_poll_s's default: seconds between reads of a running job's output
OUTPUT_POLL_S = 0.02


class RunnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The runner's options; see interface.md for each one's meaning."""

    state_dir: str | None = None
    socket: str | None = None
    socket_group: str | None = None
    listen: str | None = None
    token_file: str | None = None
    max_weight: int = 28
    max_queue_depth: int = 64
    linux_cpus: str | None = None
    windows_cpus: str | None = None
    windows_slot_lock: str | None = None
    free_space_floor_bytes: int | str | None = None
    free_space_eviction_bytes: int | str | None = None
    build_folder_cap_bytes: int | str = 64 * GiB
    workspace_root: list[str] = []
    caller_root: list[str] = []
    #: A shared compile cache directory (e.g. for sccache), handed to jobs as
    #: $MOTOR_COMPILE_CACHE; evicted only as a whole and never while a cache_fill job runs.
    compile_cache: str | None = None
    sysfs_root: str = "/sys"
    capacity_file: str = "/etc/motor-host/capacity.json"
    isolation: Isolation = "auto"
    cgroup_parent: str = "motor-jobs"
    #: systemd: slot slices (with keeperd's spares in them) made at the start for the
    #: first jobs of one CPU each, before any job asks (docs/isolation.md, "Slots made at
    #: the start"). None: one per allocatable CPU, at most --max-weight and 8; 0: none.
    start_slots: int | None = None
    memory_per_vcpu_bytes: int | str = 4 * GiB
    #: Output kept per job; above it the oldest output pages are evicted (replay then
    #: starts with a `truncated` event).
    max_output_bytes_per_job: int | str = 256 * 1024**2
    queue_wait_default_s: float = 300.0
    heartbeat_s: float = 1.0
    #: Seconds a cancel or a withdraw of a queued job waits for a busy dispatcher (a save on
    #: a slow disk or under another process's lock) before it is answered 503 `runner_busy`,
    #: the request still queued (docs/protocol.md). At most wire.CHANGE_TIMEOUT_S (30): the
    #: clients wait CHANGE_ANSWER_S (45) for that answer. Tests set it short.
    change_timeout_s: float = CHANGE_TIMEOUT_S
    #: Queued jobs' queue-wait clocks that change within this many seconds of the last
    #: clock save are saved together at its end (scheduling/machine.py CLOCK_SAVE_S): a
    #: crash loses at most this much of their courses, an orderly stop nothing. 0 saves
    #: every change at once (a commit for each start and end that flips clocks).
    clock_save_s: float = 0.25
    #: Seconds between reads of a running job's output log into the store (and so to its
    #: followers). A job that has run this long without output has its `running` record
    #: saved alone; one that ends sooner saves it with its end (docs/keeper.md, "The
    #: start's record goes with the job's next write"). Longer: less work per running job,
    #: output seen later.
    output_poll_s: float = OUTPUT_POLL_S
    #: Seconds between maintenance passes (retention, memory ceiling, disk sweeps); the seed
    #: asks for at least one a minute. Tests raise it to drive passes by hand.
    maintenance_interval_s: float = 60.0
    max_body_bytes: int = 1024 * 1024
    #: Seconds a JSON request body may take to arrive whole, and the longest pause within a
    #: bundle upload; past it the request is answered 408 and the connection closed.
    body_timeout_s: float = 30.0
    #: Seconds a connection may take to send a complete request head, after it opened or
    #: after its previous answer: an idle kept-alive connection is closed after it. At
    #: least HEAD_TIMEOUT_MIN_S, so a client's kept connection (reused within 1 s) is
    #: there when it comes back.
    head_timeout_s: float = HEAD_TIMEOUT_S
    #: Open HTTP connections (socket and TCP together); one more is answered 503
    #: too_many_connections. Clamped to RLIMIT_NOFILE less a reserve.
    max_connections: int = 1024
    #: What `motor serve` writes to its standard error (the journal under systemd): `info`
    #: adds each job's end, recoveries, adoptions and the disk manager's deletions to the
    #: warnings (docs/operations.md, "Watching it"). The embedded runner leaves logging to its
    #: host program.
    log_level: LogLevel = "info"
    #: Replaceable wall clock (tests); not settable from TOML.
    clock: object | None = None

    # -- resolved views -------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir()

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else self.state_path / "motor.sock"

    @property
    def workspace_roots(self) -> list[Path]:
        """Every allowed workspace root: each --workspace-root, then the default
        `<state>/workspaces`, which stays allowed (the seed: "add with --workspace-root"), so
        workspaces catalogued there keep expiring and stay evictable. New workspaces go into
        the first one: the first --workspace-root when given, else the default."""
        roots = [*(Path(p) for p in self.workspace_root), self.state_path / "workspaces"]
        return list(dict.fromkeys(roots))

    @property
    def caller_roots(self) -> dict[str, str]:
        """--caller-root CALLER=HOST options as {caller prefix: host dir} (validate() has
        checked their form); the one parse the dispatcher and the disk actor share."""
        return {caller: host for caller, _, host in
                (spec.partition("=") for spec in self.caller_root)}

    def floor_bytes(self) -> int:
        """The state file system's floor (0: no disk admission check)."""
        return self.floors_for(shutil.disk_usage(_existing_parent(self.state_path)).total)[0]

    def goal_bytes(self) -> int:
        return self.floors_for(shutil.disk_usage(_existing_parent(self.state_path)).total)[1]

    def floors_for(self, total_bytes: int) -> tuple[int, int]:
        """The floor and goal of a file system of `total_bytes`: as set, else min(128 GiB,
        10% of that file system) and twice the floor. A workspace root on a file system of
        its own has its own (before stop 57 it had the state file system's, so a 256 MB
        workspace root under a large state file system refused every job)."""
        if self.free_space_floor_bytes is not None:
            floor = parse_size(self.free_space_floor_bytes)
        else:
            floor = min(SEED_FLOOR_BYTES, total_bytes // 10)
        if self.free_space_eviction_bytes is not None:
            return floor, max(parse_size(self.free_space_eviction_bytes), floor)
        return floor, 2 * floor

    def validate(self) -> "RunnerConfig":
        """Check values that do not need the host; raise ConfigError with one clear line."""
        if self.linux_cpus is not None and self.max_weight == 0:
            raise ConfigError("--linux-cpus needs --max-weight above 0")
        if self.max_weight < 1:
            raise ConfigError(f"--max-weight must be at least 1, got {self.max_weight}")
        if self.max_queue_depth < 0:
            raise ConfigError(f"--max-queue-depth must be >= 0, got {self.max_queue_depth}")
        if self.start_slots is not None and not 0 <= self.start_slots <= 1024:
            raise ConfigError(f"--start-slots must be within 0..1024, got {self.start_slots}")
        if bool(self.windows_cpus) != bool(self.windows_slot_lock):
            raise ConfigError("--windows-cpus and --windows-slot-lock go together")
        for name in ("free_space_floor_bytes", "free_space_eviction_bytes",
                     "build_folder_cap_bytes", "memory_per_vcpu_bytes",
                     "max_output_bytes_per_job"):
            value = getattr(self, name)
            if value is not None:
                parse_size(value)
        for spec in self.caller_root:
            caller, sep, host = spec.partition("=")
            if not sep or not caller.startswith("/") or not host.startswith("/"):
                raise ConfigError(f"--caller-root wants CALLER=HOST with absolute paths, got {spec!r}")
        if self.listen is not None:
            host, sep, port = self.listen.rpartition(":")
            if not sep or not port.isdigit() or not host:
                raise ConfigError(f"--listen wants HOST:PORT, got {self.listen!r}")
            if not is_loopback(host) and not self.token_file:
                raise ConfigError(f"--listen on the non-loopback address {host} requires --token-file")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.cgroup_parent):
            raise ConfigError(f"--cgroup-parent must be a plain group name, got {self.cgroup_parent!r}")
        if self.heartbeat_s <= 0:
            raise ConfigError("heartbeat_s must be positive")
        if not 0 < self.change_timeout_s <= CHANGE_TIMEOUT_S:
            raise ConfigError(f"change_timeout_s must be above 0 and at most {CHANGE_TIMEOUT_S:g} "
                              f"seconds (clients wait {CHANGE_ANSWER_S:g} s for the answer), "
                              f"got {self.change_timeout_s}")
        if not 0 <= self.clock_save_s < float("inf"):
            raise ConfigError(f"clock_save_s must be 0 or more seconds, got {self.clock_save_s}")
        if not 0 < self.output_poll_s < float("inf"):
            raise ConfigError(f"output_poll_s must be a positive number of seconds, got {self.output_poll_s}")
        if not self.body_timeout_s > 0 or self.body_timeout_s == float("inf"):
            raise ConfigError(f"--body-timeout must be a positive number of seconds, got {self.body_timeout_s}")
        if not HEAD_TIMEOUT_MIN_S <= self.head_timeout_s < float("inf"):
            raise ConfigError(f"--head-timeout must be at least {HEAD_TIMEOUT_MIN_S:g} seconds "
                              f"(clients reuse a kept connection within 1 s), got {self.head_timeout_s}")
        if self.max_connections < 1:
            raise ConfigError(f"--max-connections must be at least 1, got {self.max_connections}")
        sock = os.fsencode(os.path.abspath(self.socket_path))
        if len(sock) > MAX_SOCKET_PATH:  # before stop 57: tracebacks, then exit 3 (restarted)
            raise ConfigError(
                f"the API socket {os.fsdecode(sock)} is {len(sock)} bytes long; a Unix socket's "
                f"path holds at most {MAX_SOCKET_PATH}: give --socket a shorter path (or "
                "--state-dir a shorter one)")
        return self


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8 or ::1 (brackets allowed); any other name or address is not."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def load_toml(path: str | Path) -> dict:
    """Read a config file; raise ConfigError on an unreadable or malformed one."""
    try:
        data = read_named(path)  # (a FIFO named by mistake: an error, not a wait)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        table = msgspec.toml.decode(data)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"config {path} must be a table")
    return {key.replace("-", "_"): value for key, value in table.items()}


def build_config(file_values: dict, flag_values: dict) -> RunnerConfig:
    """Defaults < file < flags; unknown keys and wrong types raise ConfigError."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    merged.pop("clock", None)
    try:
        config = msgspec.convert(merged, RunnerConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad option: {exc}") from None
    return config.validate()
