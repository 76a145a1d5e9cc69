"""Continuous batching in `vpo serve` (issue 54): rows that join a running decode group and leave it get the tokens a
plain single-request ``generate`` gives (greedy, exact), a seeded request samples the same tokens alone or beside
others, and the scheduler lets a light client join past a full batch."""

from __future__ import annotations

import threading

import pytest
import torch

from vpo_lightning.generation.models import ModelSettings, load_base_model, load_tokenizer
from vpo_lightning.serve import DecodeGroup, Job, SamplingKey, ServeSettings, build_server


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_base_model(ModelSettings(name="tiny-llama", dtype="fp32")).eval(), load_tokenizer("tiny-llama")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    yield model, tok
    torch.set_num_threads(threads)


def _group(model, tok) -> DecodeGroup:
    from vpo_lightning.generation.engines import eos_token_ids

    return DecodeGroup(model, tok, eos_token_ids(model, tok), torch.device("cpu"), threading.Lock(), adapter=True)


def _greedy(tokens: int, ignore_eos: bool = True) -> SamplingKey:
    return SamplingKey(0.0, 1.0, 0, tokens, ignore_eos, True)


def _alone(model, tok, prompt: list[int], tokens: int) -> list[int]:
    """A plain single-request greedy ``generate`` (EOS ignored: every row runs its whole budget)."""
    from vpo_lightning.generation.engines import eos_token_ids

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=sorted(eos_token_ids(model, tok)))
    return out[0, ids.shape[1] :].tolist()


def _run(group: DecodeGroup, joins: dict[int, list[Job]]) -> dict[int, list]:
    """Step ``group`` until every job is done, adding ``joins[step]`` before that step; ``id(job)`` -> choices."""
    done: dict[int, list] = {}
    step = 0
    while group.jobs or any(s >= step for s in joins):
        if step in joins:
            done.update({id(j): c for j, c in group.add(joins[step])})
        if group.jobs:
            done.update({id(j): c for j, c in group.step()})
        step += 1
    return done


def test_rows_joining_and_leaving_get_the_tokens_of_a_plain_generate(tiny):
    """Greedy rows of different prompt lengths and budgets, joining a running group at different steps (one prompt
    longer than the group's cache, so the running rows are re-padded) and leaving it at different steps, each get
    exactly the tokens of a single-request ``generate``."""
    model, tok = tiny
    prompts = [tok(text)["input_ids"] for text in
               ("Hello there", "A much longer prompt that has quite a few more tokens in it than the first one does",
                "Short", "Count: one two three four")]
    budgets = [12, 6, 9, 1]
    jobs = [Job(p, 1, _greedy(b)) for p, b in zip(prompts, budgets)]
    choices = _run(_group(model, tok), {0: [jobs[0]], 3: [jobs[1], jobs[2]], 5: [jobs[3]]})
    for job, prompt, budget in zip(jobs, prompts, budgets):
        want = tok.decode(_alone(model, tok, prompt, budget), skip_special_tokens=True)
        assert choices[id(job)][0].text == want and choices[id(job)][0].tokens == budget


def test_n_rows_share_a_prefill_and_greedy_rows_agree(tiny):
    model, tok = tiny
    prompt = tok("Tell me a story")["input_ids"]
    job = Job(prompt, 3, _greedy(7))
    choices = _run(_group(model, tok), {0: [Job(tok("Other")["input_ids"], 2, _greedy(20))], 2: [job]})[id(job)]
    want = tok.decode(_alone(model, tok, prompt, 7), skip_special_tokens=True)
    assert [c.text for c in choices] == [want] * 3


def test_a_seeded_request_samples_the_same_alone_or_beside_others(tiny):
    model, tok = tiny
    prompt = tok("Roll the dice")["input_ids"]
    key = SamplingKey(1.0, 0.9, 0, 10, True, True, seed=7)

    def texts(job_joins):
        job = Job(prompt, 2, key)
        joins = dict(job_joins)
        joins.setdefault(1, []).append(job)
        return [c.text for c in _run(_group(model, tok), joins)[id(job)]]

    alone = texts({})
    crowded = texts({0: [Job(tok("Noise noise noise")["input_ids"], 4, SamplingKey(0.7, 1.0, 5, 16, True, True))],
                     1: [Job(tok("x")["input_ids"], 1, SamplingKey(1.0, 1.0, 0, 3, True, True, seed=3))]})
    assert alone == crowded


def test_stop_strings_eos_and_hung_up_rows_leave(tiny):
    """A stop string ends its row (text cut before it); a dropped job's rows leave at the next step while the
    other rows go on."""
    model, tok = tiny
    prompt = tok("Say it")["input_ids"]
    full = tok.decode(_alone(model, tok, prompt, 12), skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    group = _group(model, tok)
    stopped, dropped = Job(prompt, 1, _greedy(12), stops=(stop,)), Job(prompt, 2, _greedy(12))
    done = {id(j): c for j, c in group.add([stopped, dropped])}
    dropped.dropped = True
    done.update({id(j): c for j, c in group.step()})
    assert id(dropped) in done and all(r.job is not dropped for r in group.rows)
    while group.jobs:
        done.update({id(j): c for j, c in group.step()})
    assert done[id(stopped)][0].text == full[: full.find(stop)] and done[id(stopped)][0].finish_reason == "stop"


def test_a_light_client_joins_past_a_full_batch_and_heavy_ones_wait(tiny):
    """Fair order, and the cap: clients holding the most rows stay within max_batch_size; a client holding fewer
    joins past it (up to twice); a hung-up job is skipped."""
    srv = build_server(*tiny, base_name="tiny-llama", port=0,
                       settings=ServeSettings(max_n=4, max_batch_size=8, batch_wait_s=0.0))
    gen = srv.generator
    try:
        heavy, light = SamplingKey(1.0, 1.0, 0, 32, True, True), SamplingKey(0.0, 1.0, 0, 1, False, True)
        gen._served, gen._vtime = {"a": 1000, "b": 950}, 900
        jobs = [Job([1], 4, heavy, client="a"), Job([1], 4, heavy, client="b"), Job([1], 4, heavy, client="a"),
                Job([1], 1, light, client="gone"), Job([1], 1, light, client="new")]
        jobs[3].dropped = True
        gen._pending = list(jobs)
        taken = gen._take(block=False)
        assert [j.client for j in taken] == ["new", "b", "a"]  # least served first; "a" joins past 8 (holds 0 < 4)
        assert jobs[3].future.cancelled() and gen._pending == [jobs[2]]
        gen._join(taken)
        assert sum(g.size for g in gen.groups) == 8  # the light job already finished in its prefill (max_tokens 1)
        assert gen._take(block=False) == []  # "a" holds the most rows: its next job waits
    finally:
        srv.server_close()
