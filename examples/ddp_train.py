"""graphamp under DistributedDataParallel: the quickstart's digits CNN, one process per CPU share or GPU.

    torchrun --nproc_per_node=2 examples/ddp_train.py [--steps 60] [--dtype bfloat16|float16]
        [--checkpoint-dir DIR] [--checkpoint-every N] [--resume DIR/step-N.pt] [--comm-hook fp16|bf16]

Processes talk over nccl on GPUs (one per process, LOCAL_RANK) and gloo on CPU. The default dtype is float16 on
CUDA, with dynamic loss scaling, and bfloat16 on CPU (float16 on CPU is about 100x slower). A DistributedSampler
deals each rank its own batches of scikit-learn's bundled digits. Rank 0 logs the loss (mean over ranks) and the
loss scale, and writes checkpoints: model, optimizer with the loss-scaling state, the step, and every rank's RNG
state, so that a run resumed from one continues the same trajectory.
"""

import argparse
import itertools
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import graphamp
from quickstart import DigitsCNN, accuracy, load_data

COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps in all, counting resumed ones")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--width", type=int, default=48, help="the CNN's channels")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], help="default: float16 on CUDA, else bfloat16")
    parser.add_argument("--incr-every-n-steps", type=int, default=2000, help="loss scaling grows after this many")
    parser.add_argument("--comm-hook", choices=sorted(COMM_HOOKS), help="all-reduce gradients in 16 bits (bf16: nccl only)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", type=Path, help="write DIR/step-N.pt there")
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: only at the end)")
    parser.add_argument("--resume", type=Path, help="a checkpoint written by this script")
    args = parser.parse_args()
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir DIR to write to")
    return args


def start_process_group() -> torch.device:
    """nccl with one GPU per process where there are GPUs, gloo on CPU; torchrun sets the rank and world size."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(directory: Path, step: int, model, optimizer, device) -> None:
    """Every rank sends its RNG state (dropout draws differ by rank); rank 0 writes the file."""
    rng_states = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, rng_state(device))
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint = {
            "step": step,
            "model": model.module.state_dict(),  # the model's own keys: loads into a DigitsCNN without graphamp
            "optimizer": optimizer.state_dict(),  # includes "loss_scaler": scale and good/bad step counters
            "rng_states": rng_states,
        }
        torch.save(checkpoint, directory / f"step-{step}.pt")
        print(f"saved {directory / f'step-{step}.pt'}", flush=True)


def load_checkpoint(path: Path, model, optimizer, device) -> int:
    # On the CPU: RNG states must stay CPU tensors; the optimizer moves its state to the parameters' device itself.
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if len(checkpoint["rng_states"]) != dist.get_world_size():
        raise SystemExit(
            f"{path} was written by {len(checkpoint['rng_states'])} processes: resume with as many "
            f"(--nproc_per_node), or the batches and dropout draws would differ."
        )
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    set_rng_state(checkpoint["rng_states"][dist.get_rank()], device)
    return checkpoint["step"]


def log(step: int, steps_per_epoch: int, loss: torch.Tensor, optimizer) -> None:
    """Rank 0 prints the loss averaged over ranks (gloo has no AVG: SUM, then divide) and the loss scale."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    if dist.get_rank() == 0:
        skipped = "  skipped: inf/NaN gradients" if optimizer.found_inf else ""
        print(
            f"step {step:4d}  epoch {(step - 1) // steps_per_epoch}  loss {loss.item() / dist.get_world_size():.6f}  "
            f"loss scale {optimizer.get_loss_scaling():g}{skipped}",
            flush=True,
        )


def batches_from(loader: DataLoader, sampler: DistributedSampler, step: int):
    """Batches from global step `step` on, epoch after epoch; the sampler's epoch fixes each epoch's order."""
    for epoch in itertools.count(step // len(loader)):
        sampler.set_epoch(epoch)
        skip = step - epoch * len(loader) if epoch == step // len(loader) else 0
        yield from itertools.islice(loader, skip, None)


def main():
    args = parse_args()
    device = start_process_group()
    rank = dist.get_rank()
    dtype = args.dtype or ("float16" if device.type == "cuda" else "bfloat16")

    torch.manual_seed(rank)  # dropout differs by rank; the weights are rank 0's, DDP broadcasts them
    (train_images, train_labels), test_data = load_data("cpu")
    dataset = TensorDataset(train_images, train_labels)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    # A generator of its own: otherwise each epoch's iterator draws from the global RNG, which checkpoints restore.
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, drop_last=True, generator=torch.Generator())

    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype)
    example = (train_images[: args.batch_size].to(device), train_labels[: args.batch_size].to(device))
    net = graphamp.rewrite(DigitsCNN(args.width).to(device), example, amp_lists=amp_lists)  # in place: the same net
    model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    if args.comm_hook:
        model.register_comm_hook(None, COMM_HOOKS[args.comm_hook])
    optimizer = graphamp.decorate(
        torch.optim.AdamW(model.parameters(), lr=args.lr), amp_lists, incr_every_n_steps=args.incr_every_n_steps,
        model=model,
    )
    step = load_checkpoint(args.resume, model, optimizer, device) if args.resume else 0
    if rank == 0:
        print(
            f"{dist.get_world_size()} processes ({dist.get_backend()}), {dtype}, {len(loader)} steps per epoch, "
            f"from step {step} to {args.steps}",
            flush=True,
        )

    model.train()
    for images, labels in batches_from(loader, sampler, step):
        if step == args.steps:
            break
        _, loss = model(images.to(device), labels.to(device))
        optimizer.zero_grad()
        optimizer.minimize(loss)
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            log(step, len(loader), loss, optimizer)
        every = args.checkpoint_every or args.steps
        if args.checkpoint_dir and (step % every == 0 or step == args.steps):
            save_checkpoint(args.checkpoint_dir, step, model, optimizer, device)

    if rank == 0:
        test_images, test_labels = test_data
        print(f"test accuracy {accuracy(net, (test_images.to(device), test_labels.to(device))):.3f}", flush=True)
    dist.barrier()  # rank 1 must not tear down gloo while rank 0 is still evaluating: that can hang rank 0's exit
    # DDP's reducer holds the group. Freed at exit, it would run gloo's destructor with the GIL held while gloo's
    # worker thread waits for the GIL to free a finished work: a deadlock (pytorch/pytorch#56297). Freed first,
    # the group's last reference goes in destroy_process_group(), whose destructor releases the GIL.
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
