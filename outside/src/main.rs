//! `outbox-relay --database-url URL --redis-url URL`: relays that database until SIGTERM
//! (`outbox-relay --help` lists every setting).

fn main() {
    std::process::exit(outbox_relay::run::main());
}
