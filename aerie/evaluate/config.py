"""Configuration of the evaluation stage."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from aerie.configbase import StrictModel
from aerie.datasets import SourceSpec
from aerie.families import DEFAULT
from aerie.families import names as family_names
from aerie.reasoning import parser_named

# A trained drafter's proposer is named by its family (`aerie.families`); prompt lookup needs none.
PROMPT_LOOKUP = "prompt_lookup"
PROPOSERS: tuple[str, ...] = (DEFAULT, PROMPT_LOOKUP)  # the default: the default family's run's


class PromptLookupConfig(StrictModel):
    """The training-free baseline proposer: copy what followed the latest match of the context's tail."""

    max_ngram: int = Field(3, ge=1, description="Longest tail n-gram looked up in the context.")
    min_ngram: int = Field(1, ge=1, description="Shortest tail n-gram tried before giving up.")


class PromptSet(StrictModel):
    """One set of prompts acceptance is measured on.

    - `mtbench`: questions in MT-Bench's `question.jsonl` format (the packaged file unless `path`), first
      turns, by category;
    - `heldout`: the corpus's held-out split, each row cut before its first answer token;
    - `prompts`: a JSONL or Parquet file of single prompts (`text_field`, optional `category_field`);
    - `conversations`: multi-turn conversations read by `source` (the generate stage's loaders and field
      mapping); each user turn is a prompt with the file's conversation before it (`turns="all"`), or
      only the first user turn (`turns="first"`);
    - `long_reasoning`: the packaged multi-step problems (math, logic, code, science, planning;
      aerie/evaluate/data/long_reasoning.jsonl) that make a thinking target reason for thousands of tokens,
      in the `prompts` format (or `path`). With thinking on (the target's default, or
      `prompt_format.chat_template_kwargs`) and a `max_new_tokens` as long as the target writes, they
      measure acceptance deep into the output (`acceptance_by_position`).
    """

    name: str = Field(pattern=r"^[a-z0-9_]+$", description="The set's name in results and figures.")
    kind: Literal["mtbench", "heldout", "prompts", "conversations", "long_reasoning"]
    path: str | None = Field(None, description="The file of an `mtbench` or `prompts` set.")
    limit: int | None = Field(None, ge=1, description="Prompts taken (MT-Bench: spread over its categories).")
    text_field: str = Field("prompt", description="`prompts`: the field holding the prompt text.")
    category_field: str | None = Field(
        "category", description="`prompts`: the field holding a category (results per category); optional."
    )
    id_field: str | None = Field("id", description="`prompts`: the field holding a prompt id; optional.")
    source: SourceSpec | None = Field(None, description="`conversations`: where and how to read them.")
    turns: Literal["first", "all"] = Field(
        "all", description="`conversations`: which user turns are prompts."
    )

    @model_validator(mode="after")
    def _inputs_match_kind(self) -> PromptSet:
        if self.kind == "prompts" and not self.path:
            raise ValueError(
                f"prompt set {self.name!r} of kind 'prompts' needs `path` (a JSONL or Parquet file)"
            )
        if self.kind == "conversations" and self.source is None:
            raise ValueError(f"prompt set {self.name!r} of kind 'conversations' needs `source`")
        if self.kind != "conversations" and self.source is not None:
            raise ValueError(f"prompt set {self.name!r}: `source` is for kind 'conversations' only")
        return self


class PromptFormat(StrictModel):
    """How prompts are rendered and completions read. In a pipeline it is the corpus's
    (corpus.chat_template, chat_template_kwargs, reasoning_parser), so the evaluation renders prompts as
    the corpus rendered the training data; set it here for a drafter evaluated on its own."""

    chat_template: str | None = Field(
        None, description="A Jinja chat template file used instead of the target's; None = the target's."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Template variables, e.g. {enable_thinking: false}."
    )
    reasoning_parser: str = Field(
        "auto",
        description="How a thinking model's reasoning is told from its answer (SGLang's --reasoning-parser "
        "names; auto = the target's family; none = no split): acceptance is reported for each apart.",
    )

    @field_validator("reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        if value not in ("auto", "none"):
            parser_named(value)  # raises, naming the parsers aerie knows
        return value


class EvaluateConfig(StrictModel):
    """Offline speculative decoding with the target and the trained drafter."""

    enabled: bool = Field(
        True,
        description="Run the offline evaluation. It loads the target in process on one device, so a target "
        "larger than one GPU is measured served instead (the deploy stage, with the server's tensor parallelism).",
    )
    num_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [3, 7], min_length=1, description="Draft chain lengths to evaluate (>= 1)."
    )
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0, 0.6, 1.0],
        description="Sampling temperatures measured: 0 is greedy (and checks losslessness output by "
        "output); above 0 the drafts are verified by speculative sampling's rejection rule, as served.",
    )
    proposers: list[str] = Field(
        default_factory=lambda: list(PROPOSERS),
        min_length=1,
        description="Proposers measured by the same evaluator (prompt lookup is the training-free baseline). "
        "A drafter is named by its family (aerie.families): a pipeline training another family than the "
        "default (eagle3) measures its own where the default is listed.",
    )
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per prompt.")
    mtbench_questions: int | None = Field(
        None, ge=1, description="MT-Bench questions used, spread over its 8 categories; None = all 80."
    )
    heldout_samples: int = Field(32, ge=0, description="Held-out corpus prompts evaluated.")
    datasets: list[PromptSet] | None = Field(
        None,
        description="The prompt sets measured; None = MT-Bench (`mtbench_questions`) and the held-out "
        "split (`heldout_samples`).",
    )
    max_prompt_tokens: int = Field(
        1024, ge=8, description="Prompts longer than this (tokens) are cut to their last this-many tokens."
    )
    batch_size: int = Field(
        8, ge=1, description="Prompts decoded together (the lossless decoder batches ragged acceptance)."
    )
    prompt_lookup: PromptLookupConfig = Field(default_factory=PromptLookupConfig)
    # Out of the repr, which the stage key hashes: at its default the keys stay what they were.
    prompt_format: PromptFormat = Field(default_factory=PromptFormat, repr=False)
    device: str = Field("auto", description="auto, cpu or cuda.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Target and drafter dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )

    def measuring(self, drafter: str) -> EvaluateConfig:
        """This config measuring a drafter of the family `drafter`: listed where the default family is
        (a default-family drafter's config, and key, stay as they are)."""
        if drafter == DEFAULT or DEFAULT not in self.proposers:
            return self
        return self.model_copy(update={"proposers": [drafter if p == DEFAULT else p for p in self.proposers]})

    def prompt_sets(self) -> list[PromptSet]:
        """The prompt sets measured, defaults filled in."""
        if self.datasets is not None:
            return self.datasets
        sets = [PromptSet(name="mtbench", kind="mtbench", limit=self.mtbench_questions)]
        if self.heldout_samples:
            sets.append(PromptSet(name="heldout", kind="heldout", limit=self.heldout_samples))
        return sets

    @model_validator(mode="after")
    def _temperatures_make_sense(self) -> EvaluateConfig:
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must list values >= 0, got {self.temperatures}")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise ValueError(f"temperatures lists a value twice: {self.temperatures}")
        unknown = [p for p in self.proposers if p != PROMPT_LOOKUP and p not in family_names()]
        if unknown:
            raise ValueError(
                f"proposers {unknown} are neither a drafter family ({', '.join(family_names())}) nor {PROMPT_LOOKUP}"
            )
        drafters = [p for p in self.proposers if p != PROMPT_LOOKUP]
        if len(set(drafters)) > 1:
            raise ValueError(f"proposers name two drafter families {drafters}: one drafter is evaluated")
        if self.datasets is not None:
            names = [d.name for d in self.datasets]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"datasets must name at least one prompt set, each once: {names}")
        return self
