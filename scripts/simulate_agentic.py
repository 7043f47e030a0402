"""`python -m scripts.simulate_agentic --out DIR`: entry point; the code lives in simulator/."""

from simulator.simulate import main

if __name__ == "__main__":
    raise SystemExit(main())
