"""Whether the reference server of `--responses server` holds the GPU this process loads the target on.

An engine takes most of every GPU it serves on (vLLM: 90% by default), so a target loaded on one of
them runs out of memory at launch, minutes in, or worse, late in a long run. Seen from this host:
the process listening on the URL's port and its descendants (an engine's workers: vLLM's
EngineCore and tensor-parallel workers) against the compute processes `nvidia-smi` lists on the
device's GPU. A server on another host, a host without `nvidia-smi` and a container that cannot see
the server's processes pass unchecked: this is a guard against the common mistake (an engine and the
extraction ranks started on the same GPUs of one node), not a scheduler.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import urllib.parse

from store.errors import ConfigError

SMI_TIMEOUT_S = 20


def local_port(url: str) -> int | None:
    """The port of a URL served on this host, else None."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name: this host's own, else another's (not resolved here: a DNS lookup may hang)
        return port if host in ("localhost", socket.gethostname(), socket.getfqdn()) else None
    if address.is_loopback or address.is_unspecified or str(address) in _host_addresses():
        return port
    return None


def _host_addresses() -> set[str]:
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}


def server_processes(port: int) -> set[int]:
    """The pids listening on `port` on this host and all their descendants (those this user can see)."""
    import psutil

    try:
        listening = {
            c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        }
    except psutil.AccessDenied:
        return set()
    pids = {p for p in listening if p}
    for pid in list(pids):
        try:
            pids |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            pass
    return pids


def gpu_processes() -> dict[str, set[int]]:
    """Compute processes per GPU UUID, as `nvidia-smi` lists them; empty without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=SMI_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, set[int]] = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        uuid, _, pid = (s.strip() for s in line.partition(","))
        if uuid and pid.isdigit():
            found.setdefault(_uuid(uuid), set()).add(int(pid))
    return found


def _uuid(text: str) -> str:
    """A GPU UUID as nvidia-smi writes it ("GPU-" and 36 characters), whichever way it came."""
    text = text.strip()
    return text if text.upper().startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def check(url: str, gpu_uuid: str, gpu_name: str) -> None:
    """Refuse, in one line, a reference server on this host whose processes hold the GPU `gpu_uuid`
    (this process's device, named `gpu_name` in the line)."""
    port = local_port(url)
    if port is None:
        return
    on_gpu = gpu_processes().get(_uuid(gpu_uuid), set())
    shared = sorted(on_gpu & server_processes(port)) if on_gpu else []
    if shared:
        raise ConfigError(
            "--server-url",
            url,
            f"is served on this host by process(es) {', '.join(map(str, shared))}, which hold {gpu_name}, the GPU "
            "this process would load the target on (an engine takes most of its GPUs' memory): give the engine "
            "and the extraction different GPUs (CUDA_VISIBLE_DEVICES), or the engine other nodes",
        )
