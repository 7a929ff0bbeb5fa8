"""The Ray connection of ``--workers``: the cluster options, joining (or starting) a cluster, its resources.

Ray is imported here, when called, and this module only with ``--workers``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from seqgen_cli.errors import SeqgenError

INSTALL_HINT = "pip install 'seqgen-cli[ray]'"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray advertises 127.0.0.1 (single-machine mode)


@dataclass
class ClusterOptions:
    """``--workers`` and friends."""

    workers: int
    address: str | None = None  # an existing cluster (``auto``, ``HOST:PORT``); None: start a local one
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    shard_size: int | None = None  # None: a few thousand, fewer for small inputs
    max_attempts: int = 3  # tries of one shard (on any worker) before the run fails
    max_restarts: int = 3  # restarts of one worker's process after it dies


def import_ray(local: bool = False) -> Any:
    """Ray, or a one-line error saying how to install it.

    ``local``: for a cluster on this machine only, Ray's addresses are loopback ones (Ray picks the
    machine's outward address otherwise: an environment setting read when Ray is first imported).
    """
    if local and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError:
        raise SeqgenError(f"--workers needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def connect(ray: Any, cluster: ClusterOptions) -> bool:
    """Join (or start) the cluster unless already connected; True when this call connected."""
    if ray.is_initialized():
        return False
    quiet = dict(log_to_driver=False, logging_level=logging.ERROR)
    if cluster.address:
        ray.init(address=cluster.address, **quiet)
    else:  # a local cluster, on loopback, with room for every worker asked for
        need = int(cluster.workers * cluster.cpus_per_worker + 0.999)
        cpus = max(os.cpu_count() or 1, need)
        ray.init(num_cpus=cpus, include_dashboard=False, **quiet)
    return True


def check_resources(ray: Any, cluster: ClusterOptions) -> None:
    """One line when the cluster has fewer CPUs or GPUs in all than one worker asks for."""
    total = ray.cluster_resources()
    for key, each in (("CPU", cluster.cpus_per_worker), ("GPU", cluster.gpus_per_worker)):
        have = total.get(key, 0.0)
        if each > have:
            raise SeqgenError(
                f"the Ray cluster has {have:g} {key}s, fewer than --{key.lower()}s-per-worker {each:g}"
            )


def node_id() -> str:
    """The Ray node this process runs on."""
    import ray

    return ray.get_runtime_context().get_node_id()
