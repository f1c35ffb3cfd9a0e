"""tests/chat_templates.py: the chat templates tests/test_chat_template.sh renders, and their
reference renderings by transformers (its own Jinja environment: trim_blocks, lstrip_blocks).

  python chat_templates.py cases OUT.json       every template x conversation x add_generation_prompt
  python chat_templates.py config NAME DIR      DIR/tokenizer_config.json with template NAME
"""
import json
import sys

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"

TEMPLATES = {
    # Qwen2's ChatML, with its default system message
    "chatml": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
              "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
              "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    # Meta-Llama-3-8B-Instruct's
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
              "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
              "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    # Phi-3-mini's
    "phi3": "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
            "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
            "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}",
    # the structure of Llama-3.1-8B-Instruct's (its tool branches, which no request here reaches, left out)
    "llama31": """{{- bos_token }}
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
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
""",
    # one that refuses a system message, as Gemma's does
    "no_system": "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                 "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}",
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  You are terse.\n"}, {"role": "user", "content": " Sort the digits: 52913 \n"}],
    [{"role": "system", "content": "Answer in digits."}, {"role": "user", "content": "Sort 52913."},
     {"role": "assistant", "content": "12359"}, {"role": "user", "content": "And 8041?"}],
    [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": " 1 2 3 "},
     {"role": "user", "content": "Again,\ttabs and ünïcode."}],
]


def render(name, messages, generation):
    from transformers.utils.chat_template_utils import _compile_jinja_template
    return _compile_jinja_template(TEMPLATES[name]).render(messages=messages, add_generation_prompt=generation,
                                                           bos_token=BOS, eos_token=EOS)


def main():
    if sys.argv[1] == "cases":
        cases = []
        for name in TEMPLATES:
            for i, messages in enumerate(CONVERSATIONS):
                for generation in (True, False):
                    if name == "no_system" and messages[0]["role"] == "system":
                        continue
                    cases.append({"name": f"{name}, conversation {i}, add_generation_prompt {generation}",
                                  "template": TEMPLATES[name], "messages": messages, "add_generation_prompt": generation,
                                  "bos_token": BOS, "eos_token": EOS, "expected": render(name, messages, generation)})
        json.dump(cases, open(sys.argv[2], "w"))
    else:
        json.dump({"chat_template": TEMPLATES[sys.argv[2]], "bos_token": {"content": BOS}, "eos_token": EOS},
                  open(f"{sys.argv[3]}/tokenizer_config.json", "w"))


if __name__ == "__main__":
    main()
