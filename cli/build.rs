//! What `better-compute version` says of the build: the target it was compiled for, and the git
//! commit when the build names one (`BETTER_COMPUTE_GIT_COMMIT=$(git rev-parse HEAD) cargo build`;
//! read from the environment, not from `.git`, so a commit in the checkout rebuilds nothing).

fn main() {
    println!("cargo:rustc-env=BC_BUILD_TARGET={}", std::env::var("TARGET").unwrap_or_default());
    println!("cargo:rerun-if-env-changed=BETTER_COMPUTE_GIT_COMMIT");
    println!("cargo:rerun-if-changed=build.rs");
}
