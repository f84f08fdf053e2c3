"""How to parse one request's output: deepseek-recipe ParsingOptions plus the scanner's start.

Converted requests carry correct options; a hand-built `ConversationRequest` does not (0.2.0 gives
it `thinking_initial_stage=None` even in thinking mode, so reasoning would leak into the answer,
and `starts_in_tool_calls=False` even when the rendered prompt opened a tool-call block). Both are
derived from the conversation here, the same way conversion derives them.

The library parser is always told `starts_in_tool_calls=False`: the adapter's scanner owns the
tool-call block (it starts in it instead) and hands the parser whole, validated blocks, spelled
the way the request's model version writes them (V4 `<｜DSML｜tool_calls>`, V4.1 `<｜DSML｜ calls>`).
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_recipe import (
    Conversation, ConversationRequest, ModelVersion, ParsingOptions, SpecialToken,
    ThinkingInitialStage,
)

from services.gateway.adapter.output_scanner import OutputScanner, Stage
from services.gateway.adapter.tool_calls import V4_TAGS, V41_TAGS, DsmlTags


@dataclass(frozen=True, slots=True)
class OutputParsing:
    thinking_stage: ThinkingInitialStage | None
    starts_in_tool_calls: bool
    parse_tool_calls: bool
    parse_json_output: bool
    stop_sequences: tuple[str, ...]
    tool_names: frozenset[str]
    dsml: str
    think_end: str
    special_tokens: object          # deepseek_recipe.SpecialTokens
    dsml_tags: DsmlTags = V4_TAGS

    def library_options(self) -> ParsingOptions:
        return ParsingOptions(
            parse_tool_calls=self.parse_tool_calls, starts_in_tool_calls=False,
            parse_json_output=self.parse_json_output, thinking_initial_stage=self.thinking_stage,
            stop_sequences=list(self.stop_sequences), special_tokens=self.special_tokens)

    def new_scanner(self) -> OutputScanner:
        if self.starts_in_tool_calls:
            start = Stage.TOOL_BLOCK
        elif self.thinking_stage is not None and self.thinking_stage.starts_in_reasoning():
            start = Stage.REASONING
        else:
            start = Stage.ANSWER
        return OutputScanner(start=start, parse_tool_calls=self.parse_tool_calls,
                             tool_names=self.tool_names, dsml=self.dsml, think_end=self.think_end,
                             tags=self.dsml_tags)


def output_parsing_for(request: ConversationRequest) -> OutputParsing:
    options = request.parsing_options
    conversation = request.conversation
    tools = conversation.tools
    stage = options.thinking_initial_stage
    if stage is None and conversation.thinking_mode:
        stage = _thinking_stage_of(conversation)
    starts_in_tool_calls = options.starts_in_tool_calls or (
        not conversation.thinking_mode and conversation.tool_choice == "required" and bool(tools))
    special = options.special_tokens
    return OutputParsing(
        thinking_stage=stage,
        starts_in_tool_calls=starts_in_tool_calls,
        parse_tool_calls=options.parse_tool_calls and conversation.tool_choice != "none",
        parse_json_output=options.parse_json_output,
        stop_sequences=tuple(options.stop_sequences),
        tool_names=frozenset(t.name for t in tools),
        dsml=special.token(SpecialToken.Dsml),
        think_end=special.token(SpecialToken.ThinkingEnd),
        special_tokens=special,
        dsml_tags=V41_TAGS if request.model_version == ModelVersion.DeepseekV41Flash else V4_TAGS,
    )


def _thinking_stage_of(conversation: Conversation) -> ThinkingInitialStage:
    messages = conversation.messages
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and last.prefix:
        if last.content:
            return ThinkingInitialStage.ContentContinuation
        if last.reasoning_content:
            return ThinkingInitialStage.ReasoningContinuation
    return ThinkingInitialStage.ReasoningStart
