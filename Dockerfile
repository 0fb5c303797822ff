# settlementd: one replica per container. Build (or podman build):
#   docker build --build-arg SETTLEMENTD_COMMIT=$(git rev-parse --short=7 HEAD) -t settlementd .
# Run: docker run -e DATABASE_URL=postgres://... -e SETTLEMENTD__SHARD__INDEX=0 \
#        -e SETTLEMENTD__SHARD__COUNT=3 -p 9464:9464 settlementd
# The dependencies are compiled in a layer of their own (cargo-chef): a change to src/ rebuilds only
# settlementd itself. What was built and run where: deploy/README.md.
FROM rust:1.95-bookworm AS chef
RUN cargo install cargo-chef --version 0.1.78 --locked
WORKDIR /src

# The recipe: Cargo.toml and Cargo.lock with every target (tests, benches) as an empty stub; it
# changes only when the dependencies do.
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS build
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --bin settlementd --recipe-path recipe.json
COPY . .
# The commit `settlementd --version` and settlementd_build_info name: the context has no .git, so
# pass it (docker build --build-arg SETTLEMENTD_COMMIT=$(git rev-parse --short=7 HEAD) .); without
# it the binary says "unknown". Declared after the dependencies' layer, which it does not change.
ARG SETTLEMENTD_COMMIT=unknown
RUN SETTLEMENTD_COMMIT="$SETTLEMENTD_COMMIT" cargo build --release --locked --bin settlementd

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates tzdata \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home settlementd
COPY --from=build /src/target/release/settlementd /usr/local/bin/settlementd
# The roles this release's migrations and grants expect, shipped with the binary: a rollback (or a
# new database) takes roles.sql from the image it runs, not from a clone of the repository.
#   podman run --rm --entrypoint cat settlementd:0.3.0 /usr/share/settlementd/sql/roles.sql
COPY deploy/sql/roles.sql /usr/share/settlementd/sql/roles.sql
USER 10001
EXPOSE 9464
ENV SETTLEMENTD__LOG__FORMAT=json
ENTRYPOINT ["settlementd"]
CMD ["serve"]
