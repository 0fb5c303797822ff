# settlementd: one replica per container. Build: docker build -t settlementd .
# Run: docker run -e DATABASE_URL=postgres://... -e SETTLEMENTD__SHARD__INDEX=0 \
#        -e SETTLEMENTD__SHARD__COUNT=3 -p 9464:9464 settlementd
FROM rust:1.95-bookworm AS build
WORKDIR /src
# Every target named in Cargo.toml (tests, benches) must exist for cargo to read the manifest.
COPY . .
RUN cargo build --release --locked --bin settlementd

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates tzdata \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home settlementd
COPY --from=build /src/target/release/settlementd /usr/local/bin/settlementd
USER 10001
EXPOSE 9464
ENV SETTLEMENTD__LOG__FORMAT=json
ENTRYPOINT ["settlementd"]
CMD ["serve"]
