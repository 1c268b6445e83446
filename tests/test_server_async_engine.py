"""AsyncEngine over the real Engine and model runner: admission errors before streaming, aborts
that free KV within one step, failed steps that fail their requests, and draining."""

from __future__ import annotations

import asyncio

import pytest

from jitney.async_engine import AsyncEngine, EngineClosedError, EngineStepError
from jitney.config import SchedulerConfig
from jitney.core.outputs import ExecutorResult, SchedulerOutput
from jitney.core.scheduler import AdmissionError, Scheduler
from jitney.engine import Engine
from jitney.llm import LLM
from jitney.request import SamplingParams

OPTIONS = dict(dtype="float32", num_blocks=32, block_size=16, max_model_len=1024, max_num_batched_tokens=64)
LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)


class FailOnDemand:
    """The real runner, except that the next step raises once ``fail_next`` is set: the engine must
    turn an executor crash into errors for the requests it holds."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.fail_next = False

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        if self.fail_next and output.chunks:
            self.fail_next = False
            raise RuntimeError("device lost")
        return self.runner.execute(output)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), **OPTIONS)


@pytest.fixture
def engine(llm):
    """A fresh scheduler (all blocks free) over the module's model runner."""
    executor = FailOnDemand(llm.runner)
    eng = Engine(Scheduler(llm.scheduler_config, llm.cache_config), executor, llm.tokenizer)
    eng.fault = executor  # type: ignore[attr-defined]
    return eng


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _started(engine: Engine) -> AsyncEngine:
    ae = AsyncEngine(engine)
    ae.start()
    return ae


async def _wait_idle(ae: AsyncEngine, num_blocks: int) -> None:
    while True:
        snap = ae.snapshot()
        if snap.num_running == snap.num_waiting == 0 and snap.num_free_blocks == num_blocks:
            return
        await asyncio.sleep(0.01)


def test_admission_errors_come_back_before_any_output(engine, llm):
    async def main():
        ae = await _started(engine)
        try:
            with pytest.raises(AdmissionError, match="max_model_len"):
                await ae.add_request([5] * 1030, SamplingParams(max_tokens=10))
            with pytest.raises(AdmissionError, match="KV"):  # 32 blocks x 16 = 512 tokens of KV
                await ae.add_request([5] * 10, SamplingParams(max_tokens=600))
            assert ae.num_in_flight == 0 and not engine.has_unfinished()
            outs = [o async for o in ae.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]
            assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 4
        finally:
            await ae.shutdown()

    run(main())


def test_closing_a_stream_frees_its_blocks_within_one_step(engine, llm):
    async def main():
        ae = await _started(engine)
        try:
            stream = await ae.add_request([9, 10, 11, 12], LONG)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            steps_at_close = engine.num_steps
            stream.close()
            await _wait_idle(ae, llm.cache_config.num_blocks)
            # The step running when the stream closed may finish; no further step runs for it.
            assert engine.num_steps - steps_at_close <= 1
        finally:
            await ae.shutdown()

    run(main())


def test_cancelled_consumer_aborts_its_request(engine, llm):
    async def consume(ae):
        async for _ in ae.generate([3, 4, 5], LONG):
            pass

    async def main():
        ae = await _started(engine)
        try:
            task = asyncio.create_task(consume(ae))
            while engine.num_steps < 3:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _wait_idle(ae, llm.cache_config.num_blocks)
            assert ae.num_in_flight == 0
        finally:
            await ae.shutdown()

    run(main())


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine, llm):
    ended = []

    async def collect(ae, prompt):
        return [o async for o in ae.generate(prompt, LONG)]

    async def main():
        ae = await _started(engine)
        ae.on_finished = ended.append
        try:
            tasks = [asyncio.create_task(collect(ae, [20 + i, 21, 22])) for i in range(3)]
            while engine.num_steps < 2:
                await asyncio.sleep(0.01)
            engine.fault.fail_next = True
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, EngineStepError) and "device lost" in str(r) for r in results)
            assert sorted(f.finish_reason for f in ended) == ["error"] * 3
            await _wait_idle(ae, llm.cache_config.num_blocks)
            outs = [o async for o in ae.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]
            assert outs[-1].finish_reason == "length"
        finally:
            await ae.shutdown()

    run(main())


def test_drain_finishes_or_aborts_and_then_refuses(engine, llm):
    async def collect(ae, params):
        return [o async for o in ae.generate([7, 8, 9], params)]

    async def main():
        ae = await _started(engine)
        try:
            short = asyncio.create_task(collect(ae, SamplingParams(max_tokens=3, ignore_eos=True)))
            long = asyncio.create_task(collect(ae, SamplingParams(max_tokens=240, ignore_eos=True)))
            while engine.num_steps < 1:
                await asyncio.sleep(0.01)
            clean = await ae.drain(timeout_s=0.0)
            assert not clean
            short_out, long_out = await short, await long
            assert short_out[-1].finish_reason in ("length", "abort")
            assert long_out[-1].finish_reason == "abort"
            with pytest.raises(EngineClosedError):
                await ae.add_request([1, 2], SamplingParams(max_tokens=2))
            await _wait_idle(ae, llm.cache_config.num_blocks)
        finally:
            await ae.shutdown()

    run(main())


def test_priority_orders_waiting_requests(llm):
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1024, queue="priority")
    engine = Engine(Scheduler(config, llm.cache_config), llm.runner, llm.tokenizer)
    finished: list[str] = []

    async def collect(ae, request_id, priority, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        stream = await ae.add_request([4, 5, 6], params, request_id=request_id, priority=priority)
        async for out in stream:
            if out.finished:
                finished.append(request_id)

    async def main():
        ae = await _started(engine)
        try:
            first = asyncio.create_task(collect(ae, "running", 0, 200))
            while engine.num_steps < 2:
                await asyncio.sleep(0.01)
            later = [asyncio.create_task(collect(ae, rid, prio, 2)) for rid, prio in
                     (("low", 5), ("lowest", 7), ("high", 1))]
            await asyncio.gather(first, *later)
        finally:
            await ae.shutdown()

    run(main())
    assert finished == ["running", "high", "low", "lowest"]
