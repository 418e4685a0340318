"""Chat templates of real model families, rendered and masked: which tokens of a multi-turn chat are targets.

The templates are the ones the models' tokenizer_config.json files ship, written out here (no download).
In the expected strings, ⟦...⟧ marks every run of target tokens; everything else is context.
"""
import itertools
import json

import pytest

import data
from data import encode_example, load_datasets, template_roles
from model.tokenizer import load_tokenizer
from tests.tiny_tokenizer import CHATML, make_test_tokenizer

# Qwen/Qwen3-0.6B. It renders an assistant turn's reasoning ('<think>...</think>' in its content) only
# for turns after the last user message, so it rewrites earlier turns as a chat grows.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501 the template verbatim, as the model's tokenizer_config.json ships it

# Qwen/Qwen2.5-0.5B-Instruct: ChatML with a default system message and tool calls.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 the template verbatim, as the model's tokenizer_config.json ships it

# meta-llama/Llama-3.1-8B-Instruct: the system turn carries a date header; tools as 'ipython'.
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 the template verbatim, as the model's tokenizer_config.json ships it

# google/gemma-2-2b-it: no system role; the assistant is 'model'; contents are trimmed.
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

# HuggingFaceTB/SmolLM2-135M-Instruct: ChatML with a default system message.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
           "trained by Hugging Face<|im_end|>\\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

QWEN_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
FAMILIES = {  # as each model's tokenizer files set BOS, EOS and the added tokens
    "qwen3": dict(chat_template=QWEN3, bos_token=None, eos_token="<|im_end|>", add_bos_token=False, tokens=QWEN_TOKENS),
    "qwen2.5": dict(chat_template=QWEN25, bos_token=None, eos_token="<|im_end|>", add_bos_token=False,
                    tokens=QWEN_TOKENS),
    "llama3": dict(chat_template=LLAMA31, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                   special_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                   "<|eom_id|>", "<|python_tag|>")),
    "gemma": dict(chat_template=GEMMA, bos_token="<bos>", eos_token="<eos>",
                  special_tokens=("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")),
    "smollm2": dict(chat_template=SMOLLM2, bos_token="<|im_start|>", eos_token="<|im_end|>"),
}

SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = load_tokenizer(make_test_tokenizer(tmp_path_factory.mktemp(name), **FAMILIES[name]))
        return made[name]
    return get


def marked(tok, ids, mask):
    """The decoded tokens, with every run of target tokens in ⟦ ⟧."""
    return "".join(f"⟦{text}⟧" if is_target else text
                   for is_target, run in itertools.groupby(zip(ids, mask), key=lambda t: t[1])
                   for text in [tok.decode([i for i, _ in run], skip_special_tokens=False)])


def check(tok, example, expected, **options):
    """encode_example(example) is exactly `expected`: its tokens are those of the rendered text (tokenized
    whole, as at inference) and its targets are the ⟦ ⟧ runs."""
    ids, mask = encode_example(example, tok, **options)
    assert marked(tok, ids, mask) == expected
    assert ids == tok.encode(expected.replace("⟦", "").replace("⟧", ""))

# ----------------------------------------------------------------------------- multi-turn chats, per family


def test_qwen3_multi_turn_trains_the_final_render(family):
    """Qwen3 drops the first turn's reasoning once a later user message exists: the first turn trains on
    its answer as the final render shows it, the last on its reasoning block and answer."""
    chat = [SYSTEM, TURNS[0], {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nhello"},
            TURNS[2], {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}]
    check(family("qwen3"), {"messages": chat},
          "<|im_start|>system\nBe brief.<|im_end|>\n"
          "<|im_start|>user\nhi<|im_end|>\n"
          "<|im_start|>assistant\n⟦hello<|im_end|>⟧\n"
          "<|im_start|>user\n2+2?<|im_end|>\n"
          "<|im_start|>assistant\n⟦<think>\nadd them\n</think>\n\n4<|im_end|>⟧\n")


def test_qwen3_without_reasoning_keeps_the_empty_think_block_as_prompt(family):
    """The empty '<think>\\n\\n</think>\\n\\n' Qwen3 writes for any answer is what its non-thinking prompt ends
    with: context, never a target."""
    check(family("qwen3"), {"messages": TURNS[:2]},
          "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n⟦hello<|im_end|>⟧\n")


def test_qwen3_tool_call_and_response(family):
    """A turn that only calls a tool is trained on the call; the tool's answer is context."""
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}]
    check(family("qwen3"), {"messages": chat},
          "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
          "<|im_start|>assistant\n⟦<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
          "</tool_call><|im_end|>⟧\n"
          "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
          "<|im_start|>assistant\n<think>\n\n</think>\n\n⟦It is sunny.<|im_end|>⟧\n")


def test_qwen25_multi_turn_with_system(family):
    check(family("qwen2.5"), {"messages": [SYSTEM] + TURNS},
          "<|im_start|>system\nBe brief.<|im_end|>\n"
          "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n⟦hello<|im_end|>⟧\n"
          "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n⟦4<|im_end|>⟧\n")


def test_qwen25_default_system_and_tool_call(family):
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}]
    check(family("qwen2.5"), {"messages": chat},
          "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
          "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
          "<|im_start|>assistant\n⟦<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
          "</tool_call><|im_end|>⟧\n"
          "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
          "<|im_start|>assistant\n⟦It is sunny.<|im_end|>⟧\n")


def test_llama3_multi_turn_with_system(family):
    check(family("llama3"), {"messages": [SYSTEM] + TURNS},
          "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
          "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n⟦hello<|eot_id|>⟧"
          "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n⟦4<|eot_id|>⟧")


def test_llama3_trims_contents_and_takes_the_tool_role(family):
    chat = [{"role": "user", "content": "  hi \n"}, {"role": "assistant", "content": "\nhello  "},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "ok"}]
    check(family("llama3"), {"messages": chat},
          "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
          "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n⟦hello<|eot_id|>⟧"
          "<|start_header_id|>ipython<|end_header_id|>\n\n\"sunny\"<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n⟦ok<|eot_id|>⟧")


def test_gemma_multi_turn(family):
    # Gemma's EOS (<eos>) is not its end of turn (<end_of_turn>): EOS is appended, and trained.
    check(family("gemma"), {"messages": TURNS},
          "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n⟦hello<end_of_turn>\n⟧"
          "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n⟦4<end_of_turn>\n<eos>⟧")


def test_smollm2_multi_turn_with_and_without_system(family):
    tok = family("smollm2")
    body = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n⟦hello<|im_end|>⟧\n"
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n⟦4<|im_end|>⟧\n")
    check(tok, {"messages": [SYSTEM] + TURNS}, "<|im_start|>system\nBe brief.<|im_end|>\n" + body)
    check(tok, {"messages": TURNS},
          "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n" + body)


@pytest.mark.parametrize("name", FAMILIES)
def test_alpaca_and_sharegpt_rows_render_as_the_same_chat(family, name):
    tok = family(name)
    chat = encode_example({"messages": TURNS[:2]}, tok)
    assert encode_example({"instruction": "hi", "output": "hello"}, tok) == chat
    assert encode_example({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
                          tok) == chat
    assert encode_example({"prompt": TURNS[:1], "completion": TURNS[1:2]}, tok) == chat

@pytest.mark.parametrize("name", FAMILIES)
def test_the_one_render_shortcut_agrees_with_the_search_per_message(family, monkeypatch, name):
    """Contents found from one rendering with every content replaced are where the search of each content on
    its own finds them; the shortcut serves every family here but for Qwen3's reasoning turns."""
    tok = family(name)
    chats = [TURNS, TURNS[:2], [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
             TURNS[:1] + [{"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}]]
    chats += [] if name == "gemma" else [[SYSTEM] + TURNS]
    one_render = data.formats._spans_in_one_render
    served = []
    def spy(*args):
        served.append(one_render(*args) is not None)
        return one_render(*args)
    monkeypatch.setattr(data.formats, "_spans_in_one_render", spy)
    shortcut = [encode_example({"messages": chat}, tok) for chat in chats]
    assert served == [name != "qwen3" or i != 3 for i in range(len(chats))]
    monkeypatch.setattr(data.formats, "_spans_in_one_render", lambda *a: None)
    assert [encode_example({"messages": chat}, tok) for chat in chats] == shortcut


# ----------------------------------------------------------------------------- system prompts, roles, errors


def test_system_prompt_is_added_where_a_row_has_none(family):
    tok = family("qwen2.5")
    with_own = encode_example({"messages": [SYSTEM] + TURNS[:2]}, tok)
    assert encode_example({"messages": TURNS[:2]}, tok, system_prompt="Be brief.") == with_own
    assert encode_example({"messages": [SYSTEM] + TURNS[:2]}, tok, system_prompt="Ignored.") == with_own


def test_a_template_error_names_the_row(family, tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    with pytest.raises(ValueError, match=r"chats\.jsonl: line 1: the chat template failed on it "
                                         r"\(TemplateError: System role not supported\)"):
        load_datasets(family("gemma"), data=str(path), system_prompt="Be brief.", cache_dir=str(tmp_path))


@pytest.mark.parametrize("name, roles", [
    ("qwen3", ("system", "user", "assistant", "tool")), ("qwen2.5", ("system", "user", "assistant", "tool")),
    ("llama3", ("system", "user", "assistant", "ipython", "tool")), ("gemma", ("system", "user", "assistant")),
    ("smollm2", ("system", "user", "assistant"))])
def test_template_roles(name, roles):
    assert template_roles(FAMILIES[name]["chat_template"]) == roles


@pytest.mark.parametrize("name, role", [("gemma", "tool"), ("smollm2", "tool"), ("qwen2.5", "bot")])
def test_a_role_the_template_does_not_take_is_refused_with_the_allowed_list(family, name, role):
    chat = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(ValueError, match=rf"row 3: a message has the role '{role}', which this chat template does not "
                                         rf"take; its roles are system, user, assistant"):
        encode_example({"messages": chat}, family(name), where="row 3")


@pytest.mark.parametrize("name, specials", [("qwen2.5", ["<|im_end|>", "<|im_start|>"]),
                                            ("llama3", ["<|eot_id|>", "<|start_header_id|>"]),
                                            ("gemma", ["<end_of_turn>", "<eos>"])])
def test_special_token_text_in_a_message_is_plain_text(family, name, specials):
    """A message that spells the template's control tokens gets them as ordinary characters, so data can
    neither end a turn early nor open a new one."""
    tok = family(name)
    user, answer = f"Is {specials[1]}assistant a role?", f"No{specials[0]} it is text."
    ids, mask = encode_example({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}]}, tok)
    plain_user, plain_answer = (tok.encode_offsets(t, parse_special=False)[0] for t in (user, answer))
    control = {tok.token_to_id(s) for s in specials}
    assert not control & set(plain_user + plain_answer)
    n_control = sum(i in control for i in encode_example({"messages": TURNS[:2]}, tok)[0])
    assert sum(i in control for i in ids) == n_control  # only the template's own
    text = "".join(tok.decode([i], skip_special_tokens=False) for i in ids)
    assert user in text and answer in text
    start = next(k for k in range(len(ids)) if ids[k:k + len(plain_answer)] == plain_answer)
    assert all(mask[start:start + len(plain_answer)])  # the answer is trained, as text


def test_special_tokens_in_raw_text_stay_special(family):
    """'text' rows are the model's input verbatim: a special token written in them is that token."""
    tok = family("qwen2.5")
    ids, _ = encode_example({"text": "<|im_start|>user\nhi<|im_end|>"}, tok)
    assert ids == [tok.token_to_id("<|im_start|>")] + tok.encode("user\nhi") + [tok.eos_id]


def test_chat_template_file_replaces_the_models(tmp_path):
    base = load_tokenizer(make_test_tokenizer(tmp_path / "base", chat_template=None))
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    with pytest.raises(ValueError, match="no chat template.*--chat-template FILE"):
        load_datasets(base, data=str(data), cache_dir=str(tmp_path / "cache"))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    train, _ = load_datasets(base, data=str(data), chat_template=str(template), cache_dir=str(tmp_path / "cache"),
                             log=lambda *a: None)
    assert marked(base, *train[0]) == ("<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                       "⟦hello<|im_end|>\n</s>⟧")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"--chat-template .*broken\.jinja is not a valid Jinja template"):
        load_datasets(base, data=str(data), chat_template=str(tmp_path / "broken.jinja"))
    with pytest.raises(FileNotFoundError, match="--chat-template: no such file"):
        load_datasets(base, data=str(data), chat_template=str(tmp_path / "missing.jinja"))

# ----------------------------------------------------------------------------- SentencePiece-style tokenizers

ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
          "{{ '<|user|>\\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n"
          "{{ '<|system|>\\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")


def sentencepiece_like(folder):
    """A TinyLlama-like tokenizer: '▁' for spaces, one prepended at the start of every text run (so
    tokenizing a piece alone differs from tokenizing it in its text), '<unk>' for unknown characters,
    and TinyLlama-Chat's (Zephyr's) template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    from tests.tiny_tokenizer import _CORPUS
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([_CORPUS] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                                show_progress=False))
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<|system|>", "<|user|>", "<|assistant|>")])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": ZEPHYR}))
    return load_tokenizer(str(folder))


def test_sentencepiece_like_tokens_are_those_of_the_whole_text(tmp_path):
    """Tokens are those of the whole rendered text, as at inference ('▁' only where the text has one); a
    token that spans the header and the answer ('\\nT') is a target; '<unk>' (for 'B', unknown to the
    vocabulary) is not taken for special text written in a message."""
    tok = sentencepiece_like(tmp_path / "tok")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "The quick fox."}]
    ids, mask = encode_example({"messages": chat}, tok)
    rendered = tok.apply_chat_template(chat)
    assert ids == [tok.bos_id] + tok.encode(rendered)
    assert [tok.id_to_token(i) for i, m in zip(ids, mask) if m] == ["\nT", "he▁qu", "ick", "▁f", "ox", ".", "</s>"]
    assert tok.token_to_id("<unk>") in ids
