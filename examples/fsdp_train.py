"""graphamp under FSDP2 with per-block sharding: a small GPT-2 language model, one process per CPU share or GPU.

    torchrun --nproc_per_node=2 examples/fsdp_train.py [--steps 30] [--layers 4] [--dtype bfloat16|float16]
        [--checkpoint-dir DIR] [--resume DIR]

FSDP2's documented order: fully_shard(block) for each block, fully_shard(model), then graphamp.rewrite(model) and
decorate(AdamW(model.parameters())). FSDP2's hooks run outside torch.compile's graphs (torch disables dynamo in
them), so each block's forward is a graph of its own, run after FSDP2 has all-gathered the block's parameters
(the twin blocks share one), and GPT-2's head and loss are another; between steps every rank holds 1/world of
the parameters. Checkpoints go through torch.distributed.checkpoint (DCP): each rank writes its shards. The data
is a synthetic next-token task (sequences counting upwards modulo the vocabulary), so the loss falls within a few
dozen steps.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

import graphamp
from ddp_train import start_process_group

VOCAB, SEQUENCE = 128, 32


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], help="default: float16 on CUDA, else bfloat16")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--checkpoint-dir", type=Path, help="write a DCP checkpoint there at the end")
    parser.add_argument("--resume", type=Path, help="a DCP checkpoint written by this script")
    return parser.parse_args()


def batch(step: int, batch_size: int, device: torch.device) -> torch.Tensor:
    """Counting sequences from a start that depends on the step and the rank: each rank sees its own."""
    generator = torch.Generator().manual_seed(step * dist.get_world_size() + dist.get_rank())
    starts = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    return ((starts + torch.arange(SEQUENCE)) % VOCAB).to(device)


def checkpoint_state(model, optimizer) -> dict:
    """The model's and optimizer's sharded state by parameter name, and the loss scaling (plain numbers)."""
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "loss_scaler": optimizer.loss_scaler.state_dict()}


def main():
    args = parse_args()
    device = start_process_group()
    dtype = args.dtype or ("float16" if device.type == "cuda" else "bfloat16")
    torch.manual_seed(0)  # FSDP2 broadcasts nothing: every rank builds the same weights
    config = GPT2Config(
        n_layer=args.layers, n_head=4, n_embd=args.width, vocab_size=VOCAB, n_positions=SEQUENCE, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).to(device)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)

    # The head in FP32, named by the model's own path.
    amp_lists = graphamp.AutoMixedPrecisionLists(dtype=dtype, custom_black_modules=["lm_head"])
    tokens = batch(0, args.batch_size, device)
    graphamp.rewrite(model, (tokens,), {"labels": tokens}, amp_lists=amp_lists)  # in place: the same model
    optimizer = graphamp.decorate(torch.optim.AdamW(model.parameters(), lr=args.lr), amp_lists, model=model)

    step = 0
    if args.resume:
        state = checkpoint_state(model, optimizer)
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        optimizer.loss_scaler.load_state_dict(state["loss_scaler"])
        step = int((args.resume / "step.txt").read_text())

    while step < args.steps:
        tokens = batch(step, args.batch_size, device)
        loss = model(tokens, labels=tokens).loss
        optimizer.zero_grad()
        optimizer.minimize(loss)
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if dist.get_rank() == 0:
                print(f"step {step:4d}  loss {mean.item() / dist.get_world_size():.6f}  "
                      f"loss scale {optimizer.get_loss_scaling():g}", flush=True)

    if args.checkpoint_dir:
        dcp.save(checkpoint_state(model, optimizer), checkpoint_id=args.checkpoint_dir)
        if dist.get_rank() == 0:
            (args.checkpoint_dir / "step.txt").write_text(str(step))
            print(f"saved {args.checkpoint_dir}", flush=True)
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"rank {dist.get_rank()} holds {local} of {total} parameters between steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
