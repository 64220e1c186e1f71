"""Word lists for TinyStories-style prompts: simple nouns, verbs and adjectives a small child knows,
story features, and first names. Fixed lists: with a shard's seed they fix every prompt."""

NOUNS = """
apple ball balloon banana bear bed bee bike bird blanket boat book bottle box boy bread bridge brother
bucket bug bunny bus butterfly cake candy cap car carrot castle cat chair cheese chicken circle clock cloud
coat cookie cow crayon crown cup dad dinosaur dog doll door dragon dress drum duck egg elephant farm fence
fish flower fog forest fox friend frog garden gift giraffe girl glass goat grandma grandpa grass hat hill
horse house ice jar jacket juice kite kitten lamp leaf lion map milk mirror monkey moon mouse mud nest
net owl park pencil penguin pie pig pillow pizza plane plate pond puppy puzzle queen rabbit rain rainbow
ring river robot rock rocket rope sand school sea seed sheep shell ship shoe sister sky snail snake snow
sock song spoon star stick stone sun swing table teacher teddy tent tiger toy tractor train tree truck
turtle umbrella wagon water whale wheel window wind wolf worm zoo basket button cave field king lake
letter mountain ocean pocket road shadow soup storm treasure village wall
""".split()

VERBS = """
bake bounce build carry catch chase clap climb collect cook count crawl cry dance dig draw dream drink
drive eat explore fall feed find fix float fly fold follow give glow grow help hide hop hug hum jump
kick kiss knock laugh learn lift listen look lose make march mix move open paint pick plant play pour
pull push race read rest ride roll run sail save search see share shine shout sing sit skip sleep slide
smell smile splash spin stack stop swim swing talk taste throw tickle touch travel try visit wait walk
wash watch wave whisper wish wonder write yell zoom borrow bring brush call cheer chew clean cover
""".split()

ADJECTIVES = """
big small tiny huge happy sad angry scared brave kind funny silly shy proud bright dark soft hard warm
cold hot wet dry clean dirty old new fast slow loud quiet sweet sour yummy shiny sparkly fluffy furry
round tall short long heavy light pretty ugly gentle lazy busy sleepy hungry thirsty curious friendly
careful clever strong weak smooth rough sticky colorful red blue green yellow purple pink orange golden
little lonely lucky magic noisy empty full wild calm excited grumpy cozy
""".split()

NAMES = """
Lily Tom Ben Mia Sam Anna Max Lucy Tim Sue Jack Emma Leo Zoe Kim Bob Ella Finn Rosa Ali Maya Jake
Nora Omar Ivy Luke Sara Dan Amy Joe Ruby Eli Lena Noah Grace Owen Pia Ravi Tara Hugo
""".split()

FEATURES = (
    "The story should contain at least one dialogue.",
    "The story has a happy ending.",
    "The story has a sad ending.",
    "Something unexpected happens in the story.",
    "The story teaches a simple lesson.",
    "In the story, two friends have a problem and solve it together.",
    "The story has a funny moment.",
    "The story is a bedtime story.",
)
