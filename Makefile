# The README's two commands. Each does all of its own set-up (cargo fetches the crates).
.PHONY: run test bench

# The main job.
run:
	cargo run --release -- overfit --model gpt
	cargo run --release -- overfit --model vit
	cargo run --release -- bench-step --steps 3

# The whole test suite, then clippy (warnings are errors) where the toolchain has it.
test:
	cargo test --all-targets
	if cargo clippy --version >/dev/null 2>&1; then cargo clippy --all-targets -- -D warnings; \
	else echo "clippy not installed: lint skipped"; fi

# Criterion benchmarks.
bench:
	cargo bench
