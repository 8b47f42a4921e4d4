# The two commands of the README: `make demo` and `make test`.
# Both create .venv/ on first use (pip install -c constraints.txt -e .).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TINY := build/tiny-llama

.PHONY: setup demo lint test test-slow test-all tiny bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	@touch $@

tiny: setup
	$(PY) llm/tools/make_tiny_model.py --output $(TINY)

demo: tiny
	$(PY) llm/run_finetune.py llm/config/tiny/sft_argument.json
	$(PY) llm/run_finetune.py llm/config/tiny/lora_argument.json
	$(PY) llm/tools/show_summary.py output/tiny_sft output/tiny_lora
	$(PY) llm/predict/predictor.py --model_name_or_path $(TINY) --lora_path output/tiny_lora --data_file llm/data/demo_prompts.json --output_file output/tiny_lora_predictions.json --src_length 128 --max_length 256

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint tiny
	$(PY) -m pytest tests -m "not slow"

# the slow end-to-end tests (CLI runs of minutes); CI (.ci/run) runs them after `make test`
test-slow: tiny
	$(PY) -m pytest tests -m slow

test-all: test test-slow

clean:
	rm -rf build output
