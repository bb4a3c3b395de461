"""Several nodes: the checks a multi-node launch needs, before launch and in each launched process.

The same `trl-gspo` command runs on every node with its own `--machine_rank`; accelerate starts torchrun there, and
the nodes meet at `--main_process_ip:--main_process_port` (torchrun's static rendezvous). Two launchers on one
machine over loopback are two nodes as far as accelerate and torch.distributed are concerned, which is how
tests/test_multinode.py runs this on CPU.

Before launch (`launch_problems`, no model and no process started): a machine rank out of range, a process count
the machines cannot share evenly, no address for the other nodes, the port already taken on the node that must
listen on it, and DeepSpeed's own multi-node launcher (pdsh by default), which is started once, not on every node.

In each launched process, before any model loads (`train.check_checkpoint_storage`): whether `output_dir` is one
filesystem all nodes see. Checkpoints are written by global rank 0 (each rank adds its own RNG and rollout files),
so on per-node disks every checkpoint would be split across the nodes and no node could resume; that is refused.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

# torchrun's static rendezvous waits this long for the other nodes (torch.distributed.elastic, static_tcp_rendezvous).
DEFAULT_JOIN_TIMEOUT_SECONDS = 600
PROBE_DIR = ".trl_gspo_storage_probe"


def _value(options, config: dict, name: str, default=None):
    """An `accelerate launch` option: the command line first, then the accelerate config file."""
    given = getattr(options, name, None)
    if given is not None:
        return given
    if name in config:
        return config[name]
    return config.get("deepspeed_config", {}).get(name, default) if name.startswith("deepspeed") else default


def join_timeout(options) -> int:
    """Seconds each node waits for the others: `--rdzv_conf timeout=N`, else torchrun's default."""
    for pair in (getattr(options, "rdzv_conf", None) or "").split(","):
        key, _, value = pair.partition("=")
        if key.strip() == "timeout" and value.strip().isdigit():
            return int(value)
    return DEFAULT_JOIN_TIMEOUT_SECONDS


def port_in_use(port: int) -> bool:
    """Whether something on this machine listens on `port` (bound the way torchrun's store binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT does not count
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def launch_problems(options, config: dict, distributed_type: str, save_on_each_node: bool = False) -> list[str]:
    """What is wrong with the launch options for several machines (or with the port on one), each naming the option
    and the fix; empty when nothing is."""
    machines = int(_value(options, config, "num_machines", 1) or 1)
    rank = int(_value(options, config, "machine_rank", 0) or 0)
    processes = int(_value(options, config, "num_processes", 1) or 1)
    ip = _value(options, config, "main_process_ip")
    port = _value(options, config, "main_process_port")
    problems = []
    if machines < 1:
        problems.append(f"`num_machines` must be >= 1, got {machines}. Fix: the number of nodes in the run.")
        return problems
    if not 0 <= rank < machines:
        problems.append(f"`machine_rank` {rank} is out of range for `num_machines` {machines}: ranks are 0 to "
                        f"{machines - 1}. Fix: run the command on each node with its own --machine_rank (0 on the "
                        "node whose address is --main_process_ip).")
    if machines > 1 and processes % machines:
        problems.append(f"`num_processes` {processes} is not divisible by `num_machines` {machines}: "
                        "num_processes counts the processes of all nodes together and each node starts the same "
                        f"number. Fix: e.g. --num_processes {machines * max(processes // machines, 1)} "
                        f"({max(processes // machines, 1)} per node).")
    if machines > 1 and not ip:
        problems.append("`main_process_ip` is not set, and with `num_machines` > 1 every node must reach the "
                        "machine_rank 0 node at it. Fix: --main_process_ip <address of the machine_rank 0 node> and "
                        "--main_process_port <a free port there>, the same on every node.")
    # Only the machine_rank 0 node listens on it, and only a launch of several processes uses it.
    if port and rank == 0 and processes > 1 and port_in_use(int(port)):
        problems.append(f"`main_process_port` {port} is already in use on this machine (another run, or a process "
                        "left from one). Fix: pick a free port and pass the same --main_process_port on every "
                        "node, or stop what holds it.")
    if machines > 1 and save_on_each_node:
        problems.append("`save_on_each_node: true` on several machines: transformers 5 writes model weights from "
                        "global rank 0 only, so the other nodes' checkpoints would have none. Fix: remove "
                        "save_on_each_node and put output_dir on a filesystem every node mounts.")
    launcher = _value(options, config, "deepspeed_multinode_launcher")
    if machines > 1 and distributed_type == "DEEPSPEED" and launcher not in ("standard", "nossh"):
        problems.append(f"DeepSpeed on {machines} machines with `deepspeed_multinode_launcher: "
                        f"{launcher or 'pdsh (accelerate default)'}`: accelerate then starts DeepSpeed's launcher, which "
                        "reaches every node itself (ssh, a hostfile) and must run on one node only, not on every "
                        "node as this command does. Fix: set `deepspeed_multinode_launcher: standard` under "
                        "deepspeed_config in the accelerate config (recipes/accelerate/zero*.yaml do) or pass "
                        "--deepspeed_multinode_launcher standard; to use pdsh, run `accelerate launch` yourself on "
                        "one node with --deepspeed_hostfile.")
    return problems


def join_note(options, config: dict) -> str | None:
    """One line for a multi-node launch: which node this is, where it meets the others, and how long it waits."""
    machines = int(_value(options, config, "num_machines", 1) or 1)
    if machines <= 1:
        return None
    rank = int(_value(options, config, "machine_rank", 0) or 0)
    where = f"{_value(options, config, 'main_process_ip')}:{_value(options, config, 'main_process_port') or 29500}"
    return (f"[trl-gspo] node {rank} of {machines}: meeting the other nodes at {where}, waiting up to "
            f"{join_timeout(options)} s for them (torchrun's rendezvous; change with --rdzv_conf timeout=SECONDS)")


def failure_hint(options, config: dict) -> str | None:
    """Printed when a multi-node launch fails: the usual causes, for the last lines of the log."""
    machines = int(_value(options, config, "num_machines", 1) or 1)
    if machines <= 1:
        return None
    return (f"trl-gspo: the launch on this node failed (see above). If it says 'waiting for clients' or 'timed out "
            f"... trying to connect', the {machines} nodes did not all join within {join_timeout(options)} s: run "
            "the same command on every node, each with its own --machine_rank, the same --num_machines, "
            "--num_processes, --main_process_ip and --main_process_port, and check that the port is open between "
            "the nodes.")


def storage_problem(shared: bool, save_on_each_node: bool, deepspeed: bool, output_dir: str) -> str | None:
    """Whether checkpoints in `output_dir` can be written and resumed, given whether all nodes see one filesystem
    there; the message names the option and the fix.

    A filesystem every node mounts is the one layout that works. `save_on_each_node` (a copy of each checkpoint on
    every node's own disk) does not, with transformers 5: `PreTrainedModel.save_pretrained` writes only on global
    rank 0 whatever the Trainer asks (`should_save_on_this_rank`), so the other nodes' checkpoints get optimizer,
    scheduler and trainer state but no weights (measured: tests/test_multinode.py). DeepSpeed also writes its
    `latest` tag from global rank 0 alone."""
    if shared and save_on_each_node:
        return (f"`save_on_each_node: true`, but every node sees the same output_dir {output_dir!r}: one process "
                "per node would write the same checkpoint files at the same time. Fix: remove save_on_each_node.")
    if save_on_each_node:
        return (f"`save_on_each_node: true` with a separate output_dir {output_dir!r} on each node: transformers 5 "
                "writes model weights from global rank 0 only, so the other nodes' checkpoints would have no "
                "weights and could not be resumed. Fix: put output_dir on a filesystem every node mounts (NFS, "
                "Lustre, a shared volume) and remove save_on_each_node.")
    if not shared:
        return (f"the nodes do not share output_dir {output_dir!r} (each sees only its own files): checkpoints, "
                f"{'DeepSpeed tags, ' if deepspeed else ''}and the built-in model are written by global rank 0 "
                "alone, so no other node could load or resume them. Fix: put output_dir on a filesystem every node "
                "mounts (NFS, Lustre, a shared volume). `save_on_each_node: true` is no way around it here: "
                "transformers 5 writes model weights from global rank 0 only.")
    return None


def nodes() -> tuple[int, int]:
    """(this process's node index, number of nodes) from torchrun's environment; (0, 1) outside a launch."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return int(os.environ.get("RANK", "0")) // max(local, 1), max(world // max(local, 1), 1)


def output_dir_is_shared(output_dir: str, wait_seconds: float = 5.0) -> bool:
    """Whether every node sees the same `output_dir`: each node's first process writes a file named after a run-wide
    token, and each looks for the others' files by name (a lookup by name is not held back by a network
    filesystem's directory cache). All processes get the same answer. Call it in every process of the launch."""
    import torch.distributed as dist

    node, count = nodes()
    if count <= 1 or not dist.is_available() or not dist.is_initialized():
        return True
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = os.path.join(output_dir, PROBE_DIR)
    mine = os.path.join(probe, f"{token[0]}.node{node}")
    if local_first:
        os.makedirs(probe, exist_ok=True)
        with open(mine, "w") as handle:
            handle.write(socket.gethostname())
    dist.barrier()
    sees_all = True
    if local_first:
        others = [os.path.join(probe, f"{token[0]}.node{n}") for n in range(count)]
        deadline = time.monotonic() + wait_seconds
        while not all(os.path.exists(path) for path in others) and time.monotonic() < deadline:
            time.sleep(0.5)
        sees_all = all(os.path.exists(path) for path in others)
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, sees_all)
    dist.barrier()  # every node has looked before any file goes
    if local_first:
        os.remove(mine)
        try:
            os.rmdir(probe)
        except OSError:  # another node's file is still there (shared), or it went first
            pass
    return all(answers)
