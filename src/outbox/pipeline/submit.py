"""Entry script for ``spark-submit``: the same commands as ``outbox pipeline``.

    spark-submit --master spark://host:7077 [shipping options] \\
        "$(python -c 'import outbox.pipeline.submit as m; print(m.__file__)')" \\
        archive --older-than 7d --to s3a://bucket/outbox-archive

``spark-submit`` creates the Spark context from its own options (``--master``,
``--conf``); the job picks up that session. See docs/pipeline.md for shipping the
package and its drivers to the executors.
"""

from __future__ import annotations


def main() -> None:
    from outbox.pipeline.commands import pipeline
    pipeline(prog_name="outbox pipeline")


if __name__ == "__main__":
    main()
