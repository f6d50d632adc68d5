"""``POST /trajectories`` on a real loopback buffer server: every validation rule refuses a bad post
with its reason, good posts form groups, and a posted trajectory is trained on."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest

from palaestra.errors import TrajectoryValidationError
from palaestra.rollout.gateway.buffer import TrajectoryBuffer
from palaestra.rollout.gateway.client import TrajectoryClient
from palaestra.rollout.gateway.server import serve_gateway
from palaestra.rollout.gateway.batches import samples_of_groups

VOCAB = 1024


def good_trajectory(reward: float = 1.0) -> dict:
    return {"token_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1],
            "logprobs": [0.0, 0.0, -0.5, -1.25], "reward": reward}


@pytest.fixture
async def buffer_server():
    buffer = TrajectoryBuffer(vocab_size=VOCAB)
    server = await serve_gateway(None, buffer=buffer)
    yield buffer, server
    await server.close()


async def post_raw(url: str, data: bytes) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.post(
        f"{url}/trajectories", data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        body = await resp.json()
        return resp.status, body["error"]["message"] if "error" in body else ""


def mutate(path: str, value) -> dict:
    """A one-group post whose field at ``path`` (dots; "-" deletes) is replaced."""
    post = {"group_id": "g", "trajectories": [good_trajectory()]}
    target = post["trajectories"][0]
    key = path
    if path.startswith("post."):
        target, key = post, path[5:]
    if value == "-":
        del target[key]
    else:
        target[key] = value
    return post


# rule -> (post, HTTP status, a piece of the reason)
RULES = {
    "body is an object": ([good_trajectory()], 400, "must be a JSON object"),
    "group id required": (mutate("post.group_id", "-"), 422, "group_id is required"),
    "token ids required": (mutate("token_ids", "-"), 422, "token_ids is required"),
    "token ids are integers": (mutate("token_ids", [5, 6.5, 7, 8]), 422,
                               "token_ids[1] is 6.5: expected an integer"),
    "token ids non-empty": ({"group_id": "g", "trajectories": [
        {"token_ids": [], "loss_mask": [], "logprobs": [], "reward": 1.0}]}, 422,
        "token_ids is empty"),
    "token ids in vocabulary": (mutate("token_ids", [5, 6, VOCAB, 8]), 422,
                                "token_ids[2] = 1024 is outside the vocabulary [0, 1024)"),
    "no negative token ids": (mutate("token_ids", [-1, 6, 7, 8]), 422, "outside the vocabulary"),
    "loss mask length": (mutate("loss_mask", [0, 1, 1]), 422,
                         "loss_mask has 3 entries but token_ids has 4"),
    "logprobs length": (mutate("logprobs", [0.0, -1.0]), 422,
                        "logprobs has 2 entries but token_ids has 4"),
    "versions length": (mutate("versions", [0, 0, 1]), 422,
                        "versions has 3 entries but token_ids has 4"),
    "loss mask is 0/1": (mutate("loss_mask", [0, 0, 2, 1]), 422, "only 0 and 1"),
    "something sampled": (mutate("loss_mask", [0, 0, 0, 0]), 422, "no sampled token"),
    "logprobs finite": (mutate("logprobs", [0.0, 0.0, float("nan"), -1.0]), 422,
                        "logprobs[2] must be finite"),
    "logprobs not infinite": (mutate("logprobs", [0.0, 0.0, -float("inf"), -1.0]), 422,
                              "must be finite"),
    "sampled logprobs <= 0": (mutate("logprobs", [0.0, 0.0, 0.7, -1.0]), 422,
                              "must be <= 0"),
    "reward required": (mutate("reward", "-"), 422, "reward is required"),
    "reward finite": (mutate("reward", float("inf")), 422, "reward must be a finite number, got inf"),
    "reward is a number": (mutate("reward", "1.0"), 422, "reward must be a finite number, got '1.0' (a string)"),
    "turn rewards finite": (mutate("turn_rewards", [0.0, float("nan")]), 422,
                            "turn_rewards[1] must be a finite number"),
    "prompt_len in range": (mutate("prompt_len", 9), 422, "prompt_len must be in [0, 4], got 9"),
    "turn ends in range": (mutate("turn_ends", [2, 9]), 422, "turn_ends must be increasing"),
    "known stop reason": (mutate("stop_reason", "finished"), 422, "stop_reason 'finished'"),
    "metadata is an object": (mutate("metadata", [1, 2]), 422, "metadata must be an object"),
    "group size positive": (mutate("post.group_size", 0), 422, "group_size must be in [1, 1024]"),
    "group not overfilled": ({"group_id": "g", "group_size": 1,
                              "trajectories": [good_trajectory(), good_trajectory()]}, 409,
                             "would hold 2 trajectories; its size is 1"),
}


@pytest.mark.parametrize("rule", sorted(RULES))
async def test_a_malformed_post_is_refused_with_its_reason(buffer_server, rule):
    buffer, server = buffer_server
    post, status, reason = RULES[rule]
    got_status, message = await post_raw(server.url, json.dumps(post).encode())
    assert (got_status, reason in message) == (status, True), message
    assert buffer.stats().get("trajectories", 0) == 0
    assert buffer.ready_count() == 0


async def test_invalid_json_is_a_400(buffer_server):
    _, server = buffer_server
    status, message = await post_raw(server.url, b"{not json")
    assert status == 400 and "not valid JSON" in message


async def test_one_bad_trajectory_refuses_the_whole_post(buffer_server):
    buffer, server = buffer_server
    bad = good_trajectory()
    bad["logprobs"] = [0.0, 0.0, math.nan, -1.0]
    client = TrajectoryClient(server.url)
    with pytest.raises(TrajectoryValidationError, match=r"HTTP 422: .*trajectories\[1\]\.logprobs\[2\]"):
        await client.apost([good_trajectory(), bad], group_id="g", group_size=2)
    assert buffer.stats().get("trajectories", 0) == 0


async def test_posts_fill_groups_and_complete_groups_are_taken_in_order(buffer_server):
    buffer, server = buffer_server
    client = TrajectoryClient(server.url)
    receipt = await asyncio.to_thread(client.post, [good_trajectory(1.0)], group_id="a",
                                      group_size=2)
    assert receipt["groups"][0]["complete"] is False
    await client.apost([{**good_trajectory(0.0), "metadata": {"difficulty": 3, "src": "x"}}],
                       group_id="a")
    await client.apost([good_trajectory(0.5)], group_id="b")  # no size: complete per post
    with pytest.raises(TrajectoryValidationError, match="HTTP 409.*already complete"):
        await client.apost([good_trajectory()], group_id="a")
    (a, b) = buffer.take()
    assert (a.group_id, b.group_id) == ("a", "b")
    assert [t.reward for t in a.trajectories] == [1.0, 0.0]
    s = a.trajectories[1].samples[0]
    assert s.token_ids_T == (5, 6, 7, 8) and s.loss_mask_T == (0, 0, 1, 1)
    assert s.versions_T == (-1, -1, 0, 0) and s.prompt_len == 2 and s.group_id == "a"
    assert a.trajectories[1].metrics["meta/difficulty"] == 3.0
    with pytest.raises(TrajectoryValidationError, match="already handed to training"):
        await client.apost([good_trajectory()], group_id="a")
    kept = samples_of_groups([a, b], ["nonzero_variance"])
    assert kept.counts == {"groups/kept": 1, "groups/filtered": 1}
    assert [x.reward for x in kept.samples] == [1.0, 0.0]


async def test_a_remote_trainer_takes_groups_over_http(buffer_server):
    buffer, server = buffer_server
    client = TrajectoryClient(server.url)
    await client.apost([good_trajectory(1.0), good_trajectory(0.0)], group_id="r", group_size=2)
    (group,) = await asyncio.to_thread(client.take)
    assert group.group_id == "r" and [t.reward for t in group.trajectories] == [1.0, 0.0]
    assert group.trajectories[0].samples[0].logprobs_T == (0.0, 0.0, -0.5, -1.25)
    assert buffer.ready_count() == 0


async def test_a_posted_trajectory_is_trained_on(model_dir, tokenizer):
    """Two posted completions of one prompt (rewards 1 and 0) -> GRPO step -> the weights move
    towards the rewarded completion."""
    import torch

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.algorithms.estimators import compute_advantages
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    torch.set_num_threads(1)
    backend = TorchBackend(model_dir, TorchBackendConfig(device="cpu", lr=3e-2, seed=0))
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    good = tokenizer.encode("The answer is 5<|im_end|>")
    bad = tokenizer.encode("I do not know<|im_end|>")
    probe = TrainBatch(token_ids=[prompt + good, prompt + bad],
                       loss_mask=[[0] * len(prompt) + [1] * len(good),
                                  [0] * len(prompt) + [1] * len(bad)])
    before = backend.forward_logprobs(probe)  # on-policy rollout logprobs of the posted tokens

    buffer = TrajectoryBuffer(vocab_size=len(tokenizer), group_size=2)
    server = await serve_gateway(None, buffer=buffer)
    try:
        posts = [{"token_ids": ids.tolist(), "loss_mask": [int(m) for m in mask.tolist()],
                  "logprobs": [float(x) * int(m) for x, m in zip(lp.tolist(), mask.tolist())],
                  "reward": reward}
                 for ids, mask, lp, reward in zip(probe.token_ids, probe.loss_mask, before,
                                                  (1.0, 0.0))]
        await TrajectoryClient(server.url).apost(posts, group_id="q1")
    finally:
        await server.close()
    kept = samples_of_groups(buffer.take(), ["nonzero_variance"])
    cfg = LossConfig(preset="grpo")
    batch = compute_advantages(TrainBatch.from_samples(kept.samples), cfg)
    weights = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    metrics = backend.train_step(batch, cfg)
    assert metrics["num_loss_tokens"] == len(good) + len(bad) and metrics["grad_norm"] > 0
    changed = [n for n, p in backend.model.named_parameters() if not torch.equal(p, weights[n])]
    assert len(changed) > 0
    after = backend.forward_logprobs(probe)
    gain = [float(((a - b) * m).sum()) for a, b, m in zip(after, before, probe.loss_mask)]
    assert gain[0] > 0 > gain[1]  # the rewarded completion became likelier, the other less


async def test_a_finished_gateway_session_lands_in_the_buffer(engine, tokenizer):
    from palaestra.engine import SamplingParams
    from palaestra.rollout.gateway.gateway import Gateway

    gateway = Gateway(engine, tokenizer, sampling=SamplingParams(max_new_tokens=6, seed=1))
    buffer = TrajectoryBuffer(vocab_size=len(tokenizer))
    server = await serve_gateway(gateway, buffer=buffer)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/sessions", json={"max_calls": 4}) as resp:
                created = await resp.json()
            import openai

            client = openai.AsyncOpenAI(base_url=created["base_url"], api_key="k", max_retries=0)
            await client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hello"}])
            sid = created["session_id"]
            async with http.post(f"{server.url}/sessions/{sid}/finish",
                                 json={"reward": 0.75, "group_id": "web-1"}) as resp:
                assert resp.status == 200, await resp.text()
            async with http.get(f"{server.url}/sessions/{sid}") as resp:
                assert resp.status == 404  # freed
    finally:
        await server.close()
    (group,) = buffer.take()
    (traj,) = group.trajectories
    assert traj.reward == 0.75 and traj.samples[0].num_sampled == 6
    assert traj.samples[0].group_id == "web-1"

