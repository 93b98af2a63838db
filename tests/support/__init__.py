"""What the test modules share: import it as `from support.<module> import ...`.

- `commands`: the `mklang` CLI run in a subprocess or in this process.
- `runs`: machines and comparisons shared by run tests.
- `examples`: the example and standard-library machines with their scenario scripts.
- `services`: the real PostgreSQL, RabbitMQ and Redis servers some tests need.
- `fakeserver`: a fake OpenAI/Anthropic HTTP model server on 127.0.0.1.
- `batches`, `fleet`: a batch machine, its inputs and the worker processes that run it.
- `models`: a priced scripted model behind the fake server.
- `providers`: a provider config and an HTTP transport at the fake server, and a provider call's error.
- `yaml_machines`: a YAML machine of every construct, hostile YAML values and a random edit of a machine.
- `files`: the files beside a checkpoint (journal, lock), the atomic write and an fsync spy.
- `journals`: a run's crash journal opened by hand and the records it reads back.
- `checkpoints`: envelopes and frame records written by hand.
- `crashes`: runs crashed in process at the points of mklang.faults, and their resumes.
- `console`: the runs the console tests serve.
- `shared`: session data built once for every xdist worker of a run.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
