//! What an image's OCI config means for its sandboxes: `Env` is the
//! sandbox's default environment (the create request's `env` overrides it,
//! an exec's `env` overrides both) and `WorkingDir` the default working
//! directory of execs and sessions. `Cmd`/`Entrypoint` are only shown by
//! inspect (the CLI's `warren run` uses them when given no command); `User`
//! is shown but not applied: every exec runs as the sandbox's root.

use std::collections::BTreeMap;

use warren_image::layer::ImageConfig;

/// The environment a sandbox records: the image's, then the request's.
pub(crate) fn sandbox_env(image: &ImageConfig, request: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env = image.env_map();
    env.extend(request.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_overrides_the_image_environment() {
        let image = ImageConfig {
            env: vec!["PATH=/opt/bin:/bin".into(), "MODE=image".into(), "MODE=later".into()],
            ..ImageConfig::default()
        };
        let request = BTreeMap::from([("MODE".to_string(), "request".to_string())]);
        let env = sandbox_env(&image, &request);
        assert_eq!(env["PATH"], "/opt/bin:/bin");
        assert_eq!(env["MODE"], "request");
        assert_eq!(sandbox_env(&image, &BTreeMap::new())["MODE"], "later");
    }
}
