"""``LLM``: offline generation over :class:`LLMEngine` (vLLM-style API).

    from pagedkv import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].text, outs[0].token_ids, outs[0].finish_reason)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.request import RequestOutput, SamplingParams
from pagedkv.errors import InvalidRequestError

Prompt = Union[str, Sequence[int]]


class LLM:
    """Offline engine. ``model``: path, ``None`` (bundled model) or a LoadedModel; keyword
    arguments are :class:`pagedkv.engine.engine.EngineConfig` options."""

    def __init__(self, model: Any = None, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        **request_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); returns outputs in prompt order.
        ``sampling_params`` is one for all or one per prompt. Every prompt is validated
        before any is queued: a bad one raises ``InvalidRequestError`` and nothing runs. When
        a step raises (or the call is interrupted), this call's unfinished requests are
        aborted before the error propagates: a later call does not run them."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError("one SamplingParams per prompt, or one for all")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(None, p, sp, **request_kwargs))
        except Exception:
            self.engine.abort_request(ids)
            self._drain()
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Union[list[dict[str, str]], Sequence[list[dict[str, str]]]],
        sampling_params: Optional[SamplingParams] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **request_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt, or with
        ``continue_final_message`` and ``add_generation_prompt=False`` leaving the final
        assistant message open) and generate. Takes one conversation (a list of {'role',
        'content'} dicts) or a list of them. Raises ``InvalidRequestError`` (see
        ``LLMEngine.apply_chat_template``)."""
        if messages and isinstance(messages[0], dict):
            convs = [messages]
        else:
            convs = list(messages)  # type: ignore[arg-type]
        prompts = [self.engine.apply_chat_template(list(c), add_generation_prompt,  # type: ignore[arg-type]
                                                   continue_final_message) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, **request_kwargs)

    def close(self) -> None:
        """Stop worker processes (tensor parallelism) and release the engine. Idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        want = set(ids)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, leave=False)
        try:
            while len(results) < len(want):
                for out in self.engine.step():
                    if out.finished and out.request_id in want:
                        results[out.request_id] = out
                        bar.update(1)
                if not self.engine.has_unfinished_requests() and len(results) < len(want):
                    break
        except BaseException:  # a failed step or Ctrl-C: this call's requests must not outlive it
            self.engine.abort_request([i for i in ids if i not in results])  # blocks freed at the next step
            raise
        finally:
            bar.close()
        return [results[i] for i in ids if i in results]
