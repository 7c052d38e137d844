"""Worker processes of the sequence-parallel tests (spawned over gloo; importable by ``spawn``).

Each rank builds the same tiny model twice: a wrapped reference run on ONE process over the full batch,
and a wrapped model under :func:`safepad.distributed.sequence_parallel`. It writes, per case, the max
relative errors of the sharded loss, logits and every parameter gradient against the reference, and the
same errors of a naive sharding (every rank's shard run alone from a zero state: what accelerate refuses).
"""

from __future__ import annotations

import json
import os
import traceback

import torch
import torch.distributed as dist

#: row layouts of 96 tokens (sequence lengths per row). At 4 ranks the edges are 24 / 48 / 72, at 2 ranks 48.
#: row 0: 5 | 30 | 3 | 40 | 18  -> a sequence crosses 24 mid-chunk, one spans 48 and 72 (rank 2 inside it)
#: row 1: 24 | 24 | 22 | 6 | 20 -> boundaries exactly at 24 and 48 (48: a chunk edge), a 6-token sequence spans 72
PACKED = [[5, 30, 3, 40, 18], [24, 24, 22, 6, 20]]
SINGLE = [[96]]


def _batch(lengths: list[list[int]], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths[0])
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])  # [B, T]
    seq = torch.cat([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])[None] for row in lengths]).int()
    labels = ids.clone()
    labels[pos == 0] = -100  # no target across a packed boundary (the collator's convention)
    return ids, pos, seq, labels


def _kwargs(boundaries: str, ids, pos, seq, labels) -> dict:
    kw = {"input_ids": ids, "labels": labels}
    if boundaries == "position_ids":
        kw["position_ids"] = pos
    elif boundaries == "seq_idx":
        kw["seq_idx"] = seq
    elif boundaries == "cu_seq_lens":
        lens = torch.tensor([int((seq[b] == s).sum()) for b in range(seq.shape[0]) for s in seq[b].unique()])
        cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).int()
        kw["cu_seq_lens_q"] = kw["cu_seq_lens_k"] = cu
    return kw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _grads(model) -> dict:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def run_case(case: dict, rank: int, world: int) -> dict:
    import safepad
    from safepad.distributed import sequence_parallel
    from safepad.testing.tiny import tiny_model

    if case.get("mismatch"):  # every rank fed a different batch: must raise on every rank, not hang
        return _mismatch(case, rank)
    if case.get("agreement"):
        return _agreement(case, rank)
    if case.get("autocast"):
        return _autocast(case, rank, world)
    family = case["family"]
    overrides = dict(case.get("overrides", {}))
    if case.get("dtype") == "float64":
        overrides["dtype"] = torch.float64
    lengths = PACKED if case["layout"] == "packed" else SINGLE
    ref = safepad.wrap(tiny_model(family, **overrides))
    ids, pos, seq, labels = _batch(lengths, ref.config.vocab_size, seed=1)
    kw = _kwargs(case["boundaries"] if case["layout"] == "packed" else "none", ids, pos, seq, labels)
    out_ref = ref(**kw)
    out_ref.loss.backward()
    g_ref = _grads(ref)

    model = safepad.wrap(tiny_model(family, **overrides))
    recomputed = []
    if case.get("checkpointing"):
        import safepad.mixers.common as common
        from safepad._tracing import in_backward as _in_backward

        orig = common.resolve_sp

        def counting(module, shape):  # records mixer forwards re-run by the checkpoint during backward
            out = orig(module, shape)
            if _in_backward():
                recomputed.append(out is not None)
            return out

        common.resolve_sp = counting
        model.gradient_checkpointing_enable()
        model.train()
    sp = sequence_parallel(model, gradients="ddp" if case.get("ddp") else "sync")
    call = model
    if case.get("ddp"):  # DDP over the same ranks averages the gradients (accelerate's prepare(model))
        call = torch.nn.parallel.DistributedDataParallel(model)
    res: dict = {}
    for step in range(case.get("steps", 1)):  # steps > 1: two forwards before one backward
        out = call(**kw)
        res.setdefault("losses", []).append(float(out.loss.detach()))
    out.loss.backward()
    if not case.get("ddp"):
        sp.sync_gradients()
    g_sp = _grads(model)
    if case.get("checkpointing"):
        common.resolve_sp = orig
        res["recomputed_with_sp"] = [sum(recomputed), len(recomputed)]
    T = ids.shape[1] // world
    res["loss_rel"] = _rel(out.loss.detach(), out_ref.loss.detach())
    res["logits_rel"] = _rel(out.logits.detach(), out_ref.logits.detach()[:, rank * T : (rank + 1) * T])
    res["grad_rel"] = {n: _rel(g_sp[n], g_ref[n]) for n in g_ref if g_ref[n].abs().max() > 0}
    res["grad_max_rel"] = max(res["grad_rel"].values())
    res["worst"] = max(res["grad_rel"], key=res["grad_rel"].get)
    res["gathered_logits_rel"] = _rel(sp.gather(out.logits.detach()), out_ref.logits.detach())
    sp.remove()

    # negative control: every rank's shard run alone from zero states (accelerate's refused configuration)
    naive = safepad.wrap(tiny_model(family, **overrides))
    sl = slice(rank * T, (rank + 1) * T)
    nkw = {k: (v[:, sl] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == ids.shape[1] else v) for k, v in kw.items()}
    nkw.pop("cu_seq_lens_q", None), nkw.pop("cu_seq_lens_k", None)
    if "cu_seq_lens_q" in kw:
        nkw["seq_idx"] = seq[:, sl]
    nkw["labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)[:, sl]
    nlog = naive(**{k: v for k, v in nkw.items() if k != "labels"}).logits
    res["naive_logits_rel"] = _rel(nlog.detach(), out_ref.logits.detach()[:, sl])
    return res


def _mismatch(case: dict, rank: int) -> dict:
    import safepad
    from safepad.distributed import sequence_parallel
    from safepad.testing.tiny import tiny_model

    model = safepad.wrap(tiny_model(case["family"]))
    sp = sequence_parallel(model)
    ids, pos, seq, labels = _batch(PACKED, model.config.vocab_size, seed=1 + rank)
    try:
        model(input_ids=ids, seq_idx=seq, labels=labels)
    except ValueError as err:
        return {"raised": str(err)}
    finally:
        sp.remove()
    return {"raised": None}


def _agreement(case: dict, rank: int) -> dict:
    """Rank-dependent inputs other than ``input_ids`` must raise on every rank, and ``sync_gradients`` misuse
    (twice, or after every micro-step of an accumulation) must raise; one accumulation done right (and one with
    ``zero_grad(set_to_none=False)`` between syncs) must equal the single-process gradients."""
    import safepad
    from safepad.distributed import sequence_parallel
    from safepad.testing.tiny import tiny_model

    family = case["family"]
    ref = safepad.wrap(tiny_model(family))
    model = safepad.wrap(tiny_model(family))
    vocab = ref.config.vocab_size
    ids, pos, seq, labels = _batch(PACKED, vocab, seed=1)
    ids2, pos2, _, labels2 = _batch(PACKED, vocab, seed=2)
    sp = sequence_parallel(model)
    res: dict = {"raised": {}}

    def attempt(what: str, **kw) -> None:
        try:
            model(**kw)
        except ValueError as err:
            res["raised"][what] = str(err)
        else:
            res["raised"][what] = None

    other = labels.clone()
    other[0, 10] = -100 if rank else other[0, 10]
    attempt("labels", input_ids=ids, position_ids=pos, labels=other)
    attempt("position_ids", input_ids=ids, labels=labels,
            position_ids=pos if rank == 0 else torch.arange(ids.shape[1]).expand_as(ids))
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    attempt("inputs_embeds", inputs_embeds=embeds + (1e-3 * rank), position_ids=pos, labels=labels)
    attempt("token_weights", input_ids=ids, position_ids=pos, labels=labels, token_weights=torch.tensor(float(rank)))

    def micro(m, i: int):
        kw = {"input_ids": ids, "position_ids": pos, "labels": labels} if i == 0 else {
            "input_ids": ids2, "position_ids": pos2, "labels": labels2}
        m(**kw).loss.backward()

    for i in (0, 1):
        micro(ref, i)
    g_ref = _grads(ref)

    def misuse(what: str, fn) -> None:
        model.zero_grad()
        try:
            fn()
        except RuntimeError as err:
            res["raised"][what] = str(err)
        else:
            res["raised"][what] = None

    misuse("double_sync", lambda: (micro(model, 0), sp.sync_gradients(), sp.sync_gradients()))
    misuse("sync_every_micro_step", lambda: (micro(model, 0), sp.sync_gradients(), micro(model, 1), sp.sync_gradients()))
    model.zero_grad()
    micro(model, 0)
    micro(model, 1)
    sp.sync_gradients()  # once, after the last micro-batch
    got = _grads(model)
    res["accumulated_grad_max_rel"] = max(_rel(got[n], g_ref[n]) for n in g_ref if g_ref[n].abs().max() > 0)
    model.zero_grad(set_to_none=False)  # in place: the next backward must not count as added onto the sum
    micro(model, 0)
    sp.sync_gradients()
    ref.zero_grad()
    micro(ref, 0)
    got, g_ref = _grads(model), _grads(ref)
    res["zeroed_grad_max_rel"] = max(_rel(got[n], g_ref[n]) for n in g_ref if g_ref[n].abs().max() > 0)
    sp.remove()
    return res


def _autocast(case: dict, rank: int, world: int) -> dict:
    """Sharded forward + backward under ``torch.autocast(cpu, bfloat16)`` against the same call on one process."""
    import safepad
    from safepad.distributed import sequence_parallel
    from safepad.testing.tiny import tiny_model

    family = case["family"]
    ref = safepad.wrap(tiny_model(family))
    ids, pos, seq, labels = _batch(PACKED, ref.config.vocab_size, seed=1)
    kw = _kwargs(case["boundaries"], ids, pos, seq, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(**kw)
    out_ref.loss.backward()
    g_ref = _grads(ref)
    model = safepad.wrap(tiny_model(family))
    sp = sequence_parallel(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**kw)
    out.loss.backward()
    sp.sync_gradients()
    g = _grads(model)
    T = ids.shape[1] // world
    res = {
        "loss_rel": _rel(out.loss.detach().float(), out_ref.loss.detach().float()),
        "logits_rel": _rel(out.logits.detach().float(), out_ref.logits.detach().float()[:, rank * T : (rank + 1) * T]),
        "grad_rel": {n: _rel(g[n].float(), g_ref[n].float()) for n in g_ref if g_ref[n].abs().max() > 0},
        "logits_dtype": str(out.logits.dtype),
    }
    res["grad_max_rel"] = max(res["grad_rel"].values())
    res["worst"] = max(res["grad_rel"], key=res["grad_rel"].get)
    sp.remove()
    return res


def worker(rank: int, world: int, init_file: str, cases: list[dict], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for case in cases:
            try:
                results[case["id"]] = run_case(case, rank, world)
            except Exception as err:  # noqa: BLE001 - reported to the test
                results[case["id"]] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
                if not case.get("expect_error"):
                    raise
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def spawn(world: int, cases: list[dict], tmp_path) -> list[dict]:
    """Run ``cases`` on ``world`` gloo processes; returns each rank's results."""
    import torch.multiprocessing as mp

    init_file = str(tmp_path / "init")
    mp.spawn(worker, args=(world, init_file, cases, str(tmp_path)), nprocs=world, join=True)
    out = []
    for r in range(world):
        with open(tmp_path / f"rank{r}.json") as f:
            out.append(json.load(f))
    return out


def _accelerate_recipe() -> dict:
    """The docs' accelerate recipe: Accelerator + prepare (DDP over the SP ranks) + gradients='ddp'.

    Returns the relative errors of the loss, of every gradient (after DDP's average) and of every parameter
    after one SGD step against the same step on one process over the full batch. Needs the env:// variables.
    """
    from accelerate import Accelerator

    import safepad
    import safepad.distributed as spd
    from safepad.testing.tiny import tiny_model

    res: dict = {}
    accelerator = Accelerator(cpu=True)
    res["distributed_type"] = str(accelerator.distributed_type)
    ref = safepad.wrap(tiny_model("nemotron_h"))
    ids, pos, seq, labels = _batch(PACKED, ref.config.vocab_size, seed=1)
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels}
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    loss_ref = ref(**batch).loss
    loss_ref.backward()
    opt_ref.step()

    model = safepad.wrap(tiny_model("nemotron_h"))
    sp = spd.sequence_parallel(model, gradients="ddp")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = accelerator.prepare(model, opt)
    res["wrapper"] = type(model).__name__
    loss = model(**{k: v.to(accelerator.device) for k, v in batch.items()}).loss
    accelerator.backward(loss)
    inner = accelerator.unwrap_model(model)
    ref_g = _grads(ref)
    got = _grads(inner)  # after DDP's average over the SP ranks: must be the unsharded gradient
    res["grad_max_rel"] = max(_rel(got[n], ref_g[n]) for n in ref_g if ref_g[n].abs().max() > 0)
    res["grads"] = sum(1 for n in ref_g if ref_g[n].abs().max() > 0)
    opt.step()
    opt.zero_grad()
    res["loss_rel"] = _rel(loss.detach(), loss_ref.detach())
    ref_p = dict(ref.named_parameters())
    res["param_max_rel"] = max(_rel(p.detach(), ref_p[n].detach()) for n, p in inner.named_parameters())
    sp.remove()
    return res


# ---------------------------------------------------------------------------------------------- Trainer

#: Trainer runs: (id, sp_size, per-device batch, gradient accumulation). The reference is ONE process with the
#: same seed and a batch of (world / sp) * per-device batch, so it sees the same examples per optimizer step,
#: in float64 (the exact reference: a single-process fp32 run is itself 3.4e-5 of conv1d.bias's scale off it).
TRAINER_CASES = [("sp4", 4, 3, 2), ("dp2xsp2", 2, 3, 1)]


def _trainer_data(vocab: int):
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 41, (36,), generator=g).tolist()
    train = [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lengths]
    evals = [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lengths[:12]]
    return train, evals


def _run_trainer(
    case_id: str, batch: int, accum: int, out: str, sp_size: int | None = None, dtype: torch.dtype = torch.float32
) -> dict:
    """A few SGD steps of the tiny Nemotron-H under transformers.Trainer; returns per-micro-step losses, the
    eval loss and the parameters (before and after) as lists."""
    from transformers import Trainer, TrainingArguments

    import safepad
    from safepad.collators import DataCollatorForPackedSSM
    from safepad.testing.tiny import tiny_model

    losses: list[float] = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    model = safepad.wrap(tiny_model("nemotron_h", dtype=dtype))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train, evals = _trainer_data(model.config.vocab_size)
    args = TrainingArguments(
        output_dir=os.path.join(out, case_id), max_steps=3, per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch, gradient_accumulation_steps=accum, optim="sgd", learning_rate=0.05,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[], save_strategy="no",
        logging_steps=1, use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False, seed=3, disable_tqdm=True,
    )
    trainer = Recording(model=model, args=args, train_dataset=train, eval_dataset=evals,
                        data_collator=DataCollatorForPackedSSM(pad_to_multiple_of=32, pad_token_id=0))
    if sp_size is not None:
        import safepad.distributed as spd

        spd.prepare_trainer(trainer, sp_size=sp_size)
    trainer.train()
    ev = trainer.evaluate()
    after = dict(model.named_parameters())
    return {"losses": losses, "eval_loss": ev["eval_loss"],
            "update": {n: (after[n].detach() - before[n]).tolist() for n in before},
            "params": {n: after[n].detach().tolist() for n in before}}


def _reset_accelerate(partial: bool) -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=partial)
    GradientState._reset_state()


def trainer_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """The accelerate and Trainer checks in ONE spawn. Ranks 0 and 1 first run the single-process Trainer
    references (before any process group exists); then all ranks run the accelerate recipe, every case of
    :data:`TRAINER_CASES` under :func:`safepad.distributed.prepare_trainer`, and the control: the SP model
    hooks alone under Trainer (its per-rank sampler) must raise, not train on mixed shards."""
    torch.set_num_threads(1)
    res: dict = {}
    try:
        for i, (cid, sp_size, batch, accum) in enumerate(TRAINER_CASES):
            if i % world == rank:  # the references run concurrently, one per rank
                res[f"ref-{cid}"] = _run_trainer(
                    f"ref-{cid}", batch * world // sp_size, accum, out_dir, dtype=torch.float64
                )
                _reset_accelerate(partial=True)
            if (i + len(TRAINER_CASES)) % world == rank:  # the same single process in float32: its own rounding
                res[f"ref32-{cid}"] = _run_trainer(f"ref32-{cid}", batch * world // sp_size, accum, out_dir)
                _reset_accelerate(partial=True)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        res["accelerate"] = _accelerate_recipe()
        _reset_accelerate(partial=False)
        for cid, sp_size, batch, accum in TRAINER_CASES:
            res[cid] = _run_trainer(cid, batch, accum, out_dir, sp_size=sp_size)
            _reset_accelerate(partial=False)
        res["control"] = _trainer_control(out_dir)
    except Exception as err:  # noqa: BLE001 - reported to the test
        res["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"trainer{rank}.json"), "w") as f:
        json.dump(res, f)


def _trainer_control(out: str) -> str | None:
    """``sequence_parallel`` alone under Trainer: each rank's sampler hands it another batch; must raise."""
    from transformers import Trainer, TrainingArguments

    import safepad
    import safepad.distributed as spd
    from safepad.collators import DataCollatorForPackedSSM
    from safepad.testing.tiny import tiny_model

    model = safepad.wrap(tiny_model("nemotron_h"))
    train, _ = _trainer_data(model.config.vocab_size)
    args = TrainingArguments(output_dir=os.path.join(out, "control"), max_steps=1, per_device_train_batch_size=3,
                             report_to=[], save_strategy="no", use_cpu=True, remove_unused_columns=False,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=train,
                      data_collator=DataCollatorForPackedSSM(pad_to_multiple_of=32, pad_token_id=0))
    spd.sequence_parallel(model, gradients="ddp")
    try:
        trainer.train()
    except ValueError as err:
        return str(err)
    return None


def spawn_trainer(world: int, tmp_path) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(trainer_worker, args=(world, port, str(tmp_path)), nprocs=world, join=True)
    out = []
    for r in range(world):
        with open(tmp_path / f"trainer{r}.json") as f:
            out.append(json.load(f))
    return out
